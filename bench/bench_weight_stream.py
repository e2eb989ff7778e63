"""How fast the CPU GEMMs stream decoder weights at decode shapes: the ceiling of our AR loop.

An AR step is ~30 layers of ``x [M, 576] @ W.T`` over weights far bigger than the caches, so its speed
is the GB/s these calls read weights at. This times torch's ``F.linear`` (the vendor GEMM, oneDNN / MKL)
and ``poss_ext.ops.linear`` (our row-invariant kernels: bf16 on AVX512-BF16 or AVX2 + FMA, fp32 on
AVX2 + FMA; elsewhere the same vendor GEMM) over a stack of SmolLM2-sized MLP weights (60 x 1536 x
576: 106 MB in bf16, 212 MB in fp32) at M = 1 / 5 / 8 / 16 rows (batch-1 decoding and 5- to 16-node
trees), against the core's plain read bandwidth (``poss.hardware.read_bandwidth_gbs``).

    PYTHONPATH=.:python python bench/bench_weight_stream.py --threads 1      # a table
    PYTHONPATH=.:python python bench/bench_weight_stream.py --rows 1 6 7 8 12 --dtypes bfloat16 --kernels poss
    PYTHONPATH=.:python pytest bench/bench_weight_stream.py --benchmark-only  # pytest-benchmark
"""

import argparse
import time

import pytest
import torch
import torch.nn.functional as F

import poss_ext

LAYERS, OUT, IN = 60, 1536, 576


def weights(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(OUT, IN, generator=g).to(dtype) for _ in range(LAYERS)]


KERNELS = {"torch": F.linear, "poss": poss_ext.ops.linear}


def stream(x, ws, kernel="torch"):
    f = KERNELS[kernel]
    for w in ws:
        f(x, w)


def gbs(ws, rows: int, kernel: str = "torch", repeats: int = 20) -> float:
    """Weight GB/s of one pass over ``ws`` at ``rows`` input rows (lower quartile of ``repeats``)."""
    x = torch.randn(rows, IN).to(ws[0].dtype)
    stream(x, ws, kernel)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        stream(x, ws, kernel)
        times.append(time.perf_counter() - t)
    times.sort()
    return sum(w.numel() * w.element_size() for w in ws) / times[len(times) // 4] / 1e9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_weight_stream(benchmark, bench_threads, dtype, rows, kernel):
    ws = weights(dtype)
    x = torch.randn(rows, IN).to(dtype)
    benchmark(stream, x, ws, kernel)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 8, 16], help="input row counts M")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    a = ap.parse_args(argv)
    from poss import hardware

    torch.set_num_threads(a.threads)
    print(f"{hardware.cpu_model()}, {a.threads} thread(s), torch {torch.__version__}, "
          f"read bandwidth {hardware.read_bandwidth_gbs():.1f} GB/s; "
          f"poss.linear kernels: bf16 {poss_ext.ops.cpu_linear_kernel(torch.bfloat16)}, "
          f"fp32 {poss_ext.ops.cpu_linear_kernel(torch.float32)}")
    rows = a.rows
    print("| dtype | kernel | weights | " + " | ".join(f"GB/s at M={m}" for m in rows) + " |")
    print("|---|---|---|" + "---|" * len(rows))
    for dtype in (getattr(torch, d) for d in a.dtypes):
        ws = weights(dtype)
        mb = sum(w.numel() * w.element_size() for w in ws) / 1e6
        for kernel in a.kernels:
            print(f"| {str(dtype).replace('torch.', '')} | {kernel} | {mb:.0f} MB | "
                  + " | ".join(f"{gbs(ws, m, kernel):.1f}" for m in rows) + " |")


if __name__ == "__main__":
    main()
