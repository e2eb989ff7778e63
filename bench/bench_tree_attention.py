"""poss.tree_attention vs torch SDPA on the CPU (run: pytest bench/bench_tree_attention.py --benchmark-only).

Verify case: prefix 2048, a random tree of N = 60 nodes, every node queries (Nq = N). Baselines over
the same keys (prefix + tree slots): SDPA with the dense [Nq, S] tree mask, and unmasked SDPA (a lower
bound: same FLOPs, no mask). Prefill case: a chain of 512 nodes (causal) vs SDPA is_causal=True.
Decode case: one query behind a prefix of 200 or 2000 keys (the row-exact path of every decode step)
vs unmasked SDPA over the same keys. Small-tree case: the root and 3 or 5 children behind 400 keys
(the 4- and 6-node verifies ``auto`` picks on a CPU) vs SDPA with the dense mask.
Compare within one benchmark group (same shapes, dtype, threads). The single-thread groups are the
steadier ones on a shared machine: with every core in use, a multi-threaded call waits for a
descheduled worker and the wall time measures the neighbours.
"""

import pytest
import torch
import torch.nn.functional as F

import poss_ext  # noqa: F401

PREFIX, NODES = 2048, 60
SHAPES = [(9, 3, 64), (32, 8, 128)]  # (Hq, Hkv, D): SmolLM2-135M, Llama-3-8B-like


def tree_inputs(B, Hq, Hkv, D, dtype):
    gen = torch.Generator().manual_seed(0)
    S = PREFIX + NODES
    q = torch.randn(B, Hq, NODES, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    parents = torch.full((B, NODES), -1, dtype=torch.int32)
    for i in range(1, NODES):
        parents[:, i] = torch.randint(max(0, i - 8), i, (B,), generator=gen, dtype=torch.int32)
    prefix_len = torch.full((B,), PREFIX, dtype=torch.int32)
    visible = torch.zeros(B, NODES, NODES, dtype=torch.bool)
    for b in range(B):
        for i in range(NODES):
            j = i
            while j >= 0:
                visible[b, i, j] = True
                j = int(parents[b, j])
    mask = torch.cat([torch.ones(B, NODES, PREFIX, dtype=torch.bool), visible], -1)[:, None]
    return q, k, v, prefix_len, parents, mask


@pytest.fixture(params=[1, 0], ids=["1thread", "allthreads"])
def threads(request):
    old = torch.get_num_threads()
    if request.param:
        torch.set_num_threads(request.param)
    yield torch.get_num_threads()
    torch.set_num_threads(old)


@pytest.mark.parametrize("impl", ["poss", "sdpa_dense_mask", "sdpa_unmasked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"Hq{s[0]}-Hkv{s[1]}-D{s[2]}")
def test_tree_verify_attention(benchmark, threads, shape, B, dtype, impl):
    Hq, Hkv, D = shape
    q, k, v, prefix_len, parents, mask = tree_inputs(B, Hq, Hkv, D, dtype)
    scale = D**-0.5
    fns = {
        "poss": lambda: torch.ops.poss.tree_attention(q, k, v, prefix_len, parents, scale),
        "sdpa_dense_mask": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=True),
        "sdpa_unmasked": lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True),
    }
    benchmark.group = f"tree N={NODES} prefix={PREFIX} Hq={Hq} Hkv={Hkv} D={D} B={B} {dtype} threads={threads}"
    benchmark.pedantic(fns[impl], rounds=10 if B == 1 else 4, warmup_rounds=1)


@pytest.mark.parametrize("impl", ["poss", "sdpa_causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chain_prefill_attention(benchmark, threads, dtype, impl):
    Hq, Hkv, D, N = 9, 3, 64, 512
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, Hq, N, D, generator=gen).to(dtype)
    k = torch.randn(1, Hkv, N, D, generator=gen).to(dtype)
    v = torch.randn(1, Hkv, N, D, generator=gen).to(dtype)
    parents = torch.arange(-1, N - 1, dtype=torch.int32)[None]
    prefix_len = torch.zeros(1, dtype=torch.int32)
    fns = {
        "poss": lambda: torch.ops.poss.tree_attention(q, k, v, prefix_len, parents, D**-0.5),
        "sdpa_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    }
    benchmark.group = f"chain prefill N={N} Hq={Hq} Hkv={Hkv} D={D} {dtype} threads={threads}"
    benchmark.pedantic(fns[impl], rounds=10, warmup_rounds=1)


@pytest.mark.parametrize("impl", ["poss", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("prefix", [200, 2000])
def test_decode_step_attention(benchmark, threads, prefix, dtype, impl):
    Hq, Hkv, D = SHAPES[0]
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, Hq, 1, D, generator=gen).to(dtype)
    k = torch.randn(1, Hkv, prefix + 1, D, generator=gen).to(dtype)
    v = torch.randn(1, Hkv, prefix + 1, D, generator=gen).to(dtype)
    parents, prefix_len = torch.full((1, 1), -1, dtype=torch.int32), torch.tensor([prefix], dtype=torch.int32)
    fns = {
        "poss": lambda: torch.ops.poss.tree_attention(q, k, v, prefix_len, parents, D**-0.5),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, scale=D**-0.5, enable_gqa=True),
    }
    benchmark.group = f"decode step prefix={prefix} Hq={Hq} Hkv={Hkv} D={D} {dtype} threads={threads}"
    benchmark.pedantic(fns[impl], rounds=200, warmup_rounds=10)


@pytest.mark.parametrize("impl", ["poss", "sdpa_dense_mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("nodes", [4, 6])
def test_small_tree_verify_attention(benchmark, threads, nodes, dtype, impl):
    """The trees ``auto`` picks on a CPU: the root and 3 or 5 children behind 400 committed keys."""
    Hq, Hkv, D, prefix = *SHAPES[0], 400
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, Hq, nodes, D, generator=gen).to(dtype)
    k = torch.randn(1, Hkv, prefix + nodes, D, generator=gen).to(dtype)
    v = torch.randn(1, Hkv, prefix + nodes, D, generator=gen).to(dtype)
    parents = torch.tensor([[-1] + [0] * (nodes - 1)], dtype=torch.int32)
    prefix_len = torch.tensor([prefix], dtype=torch.int32)
    visible = torch.eye(nodes, dtype=torch.bool)
    visible[:, 0] = True
    mask = torch.cat([torch.ones(nodes, prefix, dtype=torch.bool), visible], -1)
    fns = {
        "poss": lambda: torch.ops.poss.tree_attention(q, k, v, prefix_len, parents, D**-0.5),
        "sdpa_dense_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5,
                                                                  enable_gqa=True),
    }
    benchmark.group = f"small tree N={nodes} prefix={prefix} Hq={Hq} Hkv={Hkv} D={D} {dtype} threads={threads}"
    benchmark.pedantic(fns[impl], rounds=200, warmup_rounds=10)
