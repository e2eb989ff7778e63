"""tree_attention on CUDA: the Triton kernel (poss_ext/triton_attention.py) vs the CUDA kernel.

    pytest bench/bench_triton_attention.py --benchmark-only --benchmark-json=out/triton_attention.json
    python bench/report.py out/triton_attention.json

Verify rounds of SmolLM2-135M (Hq = 9, Hkv = 3, D = 64): a random tree of N = 60 nodes that all
query (Nq = N), prefixes of 512 and 2048 slots, B = 1 and 4, bf16. One timed call is one op call
followed by a synchronize, so it includes what the host spends launching (Python argument checks
and up to three kernels, two fills and an assert for Triton; one C++ call for the CUDA op): what an
eager decode round pays. The `triton / poss` column says how many times longer the Triton path
took. Skipped without a GPU, and
the CUDA op's row when POSS_ATTENTION=triton makes the op itself the Triton kernel.
"""

import pytest
import torch

import poss_ext

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and poss_ext.build_info()["cuda"]),
                                reason="needs a visible CUDA GPU and poss_ext built with CUDA kernels")

NODES, HQ, HKV, D = 60, 9, 3, 64


def verify_inputs(B: int, prefix: int, dtype: torch.dtype):
    """q ``[B, 9, 60, 64]``, caches ``[B, 3, prefix + 60, 64]``, prefix_len, parents (each node's parent
    among the 8 nodes before it: a bushy tree of depth about 10), all on the GPU."""
    gen = torch.Generator().manual_seed(0)
    S = prefix + NODES
    q = torch.randn(B, HQ, NODES, D, generator=gen).to(dtype)
    k = torch.randn(B, HKV, S, D, generator=gen).to(dtype)
    v = torch.randn(B, HKV, S, D, generator=gen).to(dtype)
    parents = torch.full((B, NODES), -1, dtype=torch.int32)
    for i in range(1, NODES):
        parents[:, i] = torch.randint(max(0, i - 8), i, (B,), generator=gen, dtype=torch.int32)
    prefix_len = torch.full((B,), prefix, dtype=torch.int32)
    return tuple(t.cuda() for t in (q, k, v, prefix_len, parents))


@pytest.mark.parametrize("impl", ["poss", "triton"])
@pytest.mark.parametrize("prefix", [512, 2048])
@pytest.mark.parametrize("B", [1, 4])
def test_verify_attention_cuda(benchmark, B, prefix, impl):
    if impl == "poss" and poss_ext.ops.ATTENTION_BACKEND != "cuda":
        pytest.skip("POSS_ATTENTION=triton: torch.ops.poss.tree_attention is the Triton kernel")
    from poss_ext.triton_attention import tree_attention_triton

    dtype = torch.bfloat16
    q, k, v, prefix_len, parents = verify_inputs(B, prefix, dtype)
    op = {"poss": torch.ops.poss.tree_attention, "triton": tree_attention_triton}[impl]

    def fn():
        out = op(q, k, v, prefix_len, parents, D**-0.5)
        torch.cuda.synchronize()
        return out

    fn()  # compiles the Triton kernels for this shape before timing
    benchmark.group = f"tree_cuda N={NODES} prefix={prefix} Hq={HQ} Hkv={HKV} D={D} B={B} {dtype}"
    benchmark.extra_info.update(B=B, prefix=prefix, N=NODES, dtype=str(dtype), impl=impl)
    out = benchmark.pedantic(fn, rounds=50, iterations=5, warmup_rounds=5)
    if impl == "triton" and poss_ext.ops.ATTENTION_BACKEND == "cuda":  # a timing of a wrong kernel is no timing
        want = torch.ops.poss.tree_attention(q, k, v, prefix_len, parents, D**-0.5)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
