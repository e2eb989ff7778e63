"""poss.kv_compact vs torch index_select / index_copy_ (run:
pytest bench/bench_kv_compact.py --benchmark-only).

SmolLM2-135M shapes: L = 30 layers, Hkv = 3, D = 64, S = 2048 slots, a 60-node tree at prefix
1900, an accepted path of length 6 (root + 5 nodes), B in {1, 16}. Each call moves
2 * L * B * Hkv * 5 rows of D elements.

Threads: POSS_BENCH_THREADS (default 1). The 2-core development box is shared and usually
loaded, so a multi-threaded run there mostly measures how long the OS takes to schedule the second
OpenMP thread; single-threaded numbers are the stable ones.
"""


import pytest
import torch

import poss_ext  # noqa: F401
from poss_ext import reference

L, H, D, S, N, PREFIX = 30, 3, 64, 2048, 60, 1900
PATH = [0, 3, 9, 17, 30, 44]


def inputs(B, dtype):
    k = torch.randn(L, B, H, S, D).to(dtype)
    v = torch.randn(L, B, H, S, D).to(dtype)
    prefix_len = torch.full((B,), PREFIX, dtype=torch.int32)
    accept_nodes = torch.full((B, N), -1, dtype=torch.int32)
    accept_nodes[:, : len(PATH)] = torch.tensor(PATH, dtype=torch.int32)
    accept_len = torch.full((B,), len(PATH) - 1, dtype=torch.int32)
    return k, v, prefix_len, accept_nodes, accept_len


def torch_index_compact(k, v, prefix_len, accept_nodes, accept_len):
    # The host reads the move lists once (what a caller without the op would do), then one
    # gather and one scatter per request and cache, over all layers and heads at once.
    pre, nodes, lens = prefix_len.tolist(), accept_nodes.tolist(), accept_len.tolist()
    for b in range(k.shape[1]):
        src = torch.tensor([pre[b] + a for a in nodes[b][: lens[b] + 1]])
        dst = torch.arange(pre[b], pre[b] + lens[b] + 1)
        for cache in (k, v):
            view = cache[:, b]
            view.index_copy_(2, dst, view.index_select(2, src))


pytestmark = pytest.mark.usefixtures("bench_threads")


IMPLS = {
    "poss": torch.ops.poss.kv_compact,
    "torch_index_select_copy": torch_index_compact,
    "reference": reference.kv_compact,
}


def test_baseline_agrees():
    a = inputs(2, torch.float32)
    b = tuple(t.clone() for t in a)
    torch.ops.poss.kv_compact(*a)
    torch_index_compact(*b)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("B", [1, 16])
def test_kv_compact(benchmark, B, dtype, impl):
    args = inputs(B, dtype)
    benchmark.group = f"kv_compact L={L} Hkv={H} D={D} S={S} path={len(PATH)} B={B} {dtype}"
    benchmark.pedantic(IMPLS[impl], args=args, rounds=30, warmup_rounds=1)
