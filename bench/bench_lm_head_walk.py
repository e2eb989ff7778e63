"""The verify round's lm_head: all B*N tree rows at once, or only the rows a greedy walk reaches.

A greedy verify needs the target's logits only on the accepted path (plus the node where it stops).
Computing them all is one GEMM of B*N rows over the lm_head (SmolLM2: 49,152 x 576), which is
compute-bound on a CPU once B*N passes about 8; the walk does one GEMM of B rows per level, each
about one pass over the weights. This times both with our ``poss_ext.ops.linear`` and prints where the
walk starts to pay (``poss.decode.verify.LAZY_LM_HEAD_MIN_ROWS``).

    PYTHONPATH=.:python python bench/bench_lm_head_walk.py --threads 1     # a table
    PYTHONPATH=.:python pytest bench/bench_lm_head_walk.py --benchmark-only
"""

import argparse
import time

import pytest
import torch

import poss_ext

VOCAB, HIDDEN = 49152, 576


def lm_head(dtype):
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)).to(dtype)


def full(w, batch: int, nodes: int):
    poss_ext.ops.linear(torch.ones(batch * nodes, HIDDEN, dtype=w.dtype), w)


def walk(w, batch: int, levels: int):
    x = torch.ones(batch, HIDDEN, dtype=w.dtype)
    for _ in range(levels):
        poss_ext.ops.linear(x, w).argmax(1)


def ms(f, *args, repeats: int = 10) -> float:
    f(*args)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(*args)
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[len(times) // 4]


@pytest.mark.parametrize("batch,nodes", [(1, 60), (1, 8), (16, 5)])
def test_full_lm_head(benchmark, bench_threads, batch, nodes):
    benchmark(full, lm_head(torch.bfloat16), batch, nodes)


@pytest.mark.parametrize("batch,levels", [(1, 2), (16, 2)])
def test_walked_lm_head(benchmark, bench_threads, batch, levels):
    benchmark(walk, lm_head(torch.bfloat16), batch, levels)


def main() -> None:
    from poss.hardware import header

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--levels", type=int, default=2, help="walk levels (accepted length + 1; tau ~ 2 here)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    w = lm_head(dtype)
    print(header(dtype, a.threads))
    print(f"\n| batch | nodes | rows | full ms | walk ms ({a.levels} levels) | walk / full |\n|---|---|---|---|---|---|")
    for batch, nodes in [(1, 4), (1, 8), (1, 16), (1, 32), (1, 60), (4, 5), (16, 5), (16, 8)]:
        f, g = ms(full, w, batch, nodes), ms(walk, w, batch, a.levels)
        print(f"| {batch} | {nodes} | {batch * nodes} | {f:.2f} | {g:.2f} | {g / f:.2f} |")


if __name__ == "__main__":
    main()
