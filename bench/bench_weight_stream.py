"""How fast torch's CPU GEMM streams decoder weights at decode shapes: the ceiling of our AR loop.

An AR step is ~30 layers of ``x [M, 576] @ W.T`` over weights far bigger than the caches, so its speed
is the GB/s these calls read weights at. This times ``F.linear`` over a stack of SmolLM2-sized MLP
weights (60 x 1536 x 576: 106 MB in bf16, 212 MB in fp32) at M = 1 / 8 / 16 rows (batch-1 decoding
and 8- / 16-node trees), against the core's plain read bandwidth (``poss.hardware.read_bandwidth_gbs``).

    PYTHONPATH=.:python python bench/bench_weight_stream.py --threads 1      # a table
    PYTHONPATH=.:python pytest bench/bench_weight_stream.py --benchmark-only  # pytest-benchmark
"""

import argparse
import time

import pytest
import torch
import torch.nn.functional as F

LAYERS, OUT, IN = 60, 1536, 576


def weights(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(OUT, IN, generator=g).to(dtype) for _ in range(LAYERS)]


def stream(x, ws):
    for w in ws:
        F.linear(x, w)


def gbs(ws, rows: int, repeats: int = 20) -> float:
    """Weight GB/s of one pass over ``ws`` at ``rows`` input rows (lower quartile of ``repeats``)."""
    x = torch.randn(rows, IN).to(ws[0].dtype)
    stream(x, ws)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        stream(x, ws)
        times.append(time.perf_counter() - t)
    times.sort()
    return sum(w.numel() * w.element_size() for w in ws) / times[len(times) // 4] / 1e9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 8])
def test_weight_stream(benchmark, bench_threads, dtype, rows):
    ws = weights(dtype)
    x = torch.randn(rows, IN).to(dtype)
    benchmark(stream, x, ws)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    from poss import hardware

    torch.set_num_threads(a.threads)
    print(f"{hardware.cpu_model()}, {a.threads} thread(s), torch {torch.__version__}, "
          f"read bandwidth {hardware.read_bandwidth_gbs():.1f} GB/s")
    print("| dtype | weights | GB/s at M=1 | M=8 | M=16 |\n|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        ws = weights(dtype)
        mb = sum(w.numel() * w.element_size() for w in ws) / 1e6
        print(f"| {str(dtype).replace('torch.', '')} | {mb:.0f} MB | "
              + " | ".join(f"{gbs(ws, m):.1f}" for m in (1, 8, 16)) + " |")


if __name__ == "__main__":
    main()
