"""Cases of the Triton tree_attention kernel, run in a child process (see tests/ops/test_triton_attention.py).

    TRITON_INTERPRET=1 python tests/helpers/triton_attention_cases.py [NAME ...]   # CPU, interpreted
    python tests/helpers/triton_attention_cases.py --compile                        # sm_80 / sm_90 builds

Interpreted, each case runs ``poss_ext.triton_attention.tree_attention_triton`` on CPU tensors and
compares it with ``poss_ext.reference.tree_attention`` (or checks the error a bad input raises). With
``--compile`` the kernels are compiled ahead of time for CUDA targets, which needs no GPU: it catches
what the interpreter does not check (lowering, shared memory). Prints one JSON line per case:
``{"case": ..., "ok": ..., "detail": ...}``.

A child process because triton reads TRITON_INTERPRET when it decorates the kernels: the test
process may already have imported them, or triton, without it.
"""

import json
import re
import sys
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `helpers` when run as a script

from helpers.tree_cases import random_parents  # noqa: E402
from poss_ext import reference  # noqa: E402

TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def make(seed, B, Hq, Hkv, Nq, N, D, prefix, n_real, shape="random", dtype=torch.float32, extra_slots=3):
    """Inputs of one call: ``parents`` from helpers.tree_cases (padding after ``n_real[b]``)."""
    rng = np.random.default_rng(seed)
    parents = torch.from_numpy(np.stack([random_parents(rng, n, N, shape) for n in n_real]))
    prefix_len = torch.tensor(prefix, dtype=torch.int32)
    S = max(prefix) + N + extra_slots
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    return q, k, v, prefix_len, parents


def compare(q, k, v, prefix_len, parents, scale=None, num_splits=None):
    """The kernel against the reference; padding queries must be exactly 0. Returns the max error."""
    from poss_ext.triton_attention import tree_attention_triton

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = tree_attention_triton(q, k, v, prefix_len, parents, scale, num_splits=num_splits)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    want = reference.tree_attention(q, k, v, prefix_len, parents, scale)
    atol, rtol = TOL[q.dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=rtol)
    N, Nq = parents.shape[1], q.shape[2]
    for b in range(parents.shape[0]):
        n_real = reference.real_nodes(parents[b].tolist())
        first_pad_query = max(0, n_real - (N - Nq))
        assert torch.all(out[b, :, first_pad_query:] == 0), f"padding queries of request {b} are not 0"
    return float((out.float() - want.float()).abs().max())


# ---- Agreement with the reference -------------------------------------------------------------


def chain_causal():
    # Chains are causal attention, with prefixes of 5 and 0 slots; GQA ratio 1.
    return compare(*make(1, B=2, Hq=2, Hkv=2, Nq=24, N=24, D=64, prefix=[5, 0], n_real=[24, 17], shape="chain"))


def long_chain_past_the_mask():
    # 300 nodes (> 256: no mask rows exist past node 255), the last 16 queried.
    return compare(*make(2, B=1, Hq=2, Hkv=1, Nq=16, N=300, D=64, prefix=[3], n_real=[300], shape="chain"))


def random_trees_gqa3_d128():
    # Nq < N, a request whose queries are all padding, prefix_len 0; GQA ratio 3.
    return compare(*make(3, B=3, Hq=6, Hkv=2, Nq=8, N=20, D=128, prefix=[37, 0, 5], n_real=[20, 15, 1]))


def star_trees_gqa1_d64():
    return compare(*make(4, B=2, Hq=3, Hkv=3, Nq=12, N=12, D=64, prefix=[9, 0], n_real=[12, 7], shape="star"))


def split_prefix_and_merge():
    # Several prefix splits of whole key tiles, one starting past a short prefix, then the merge.
    args = make(5, B=3, Hq=6, Hkv=2, Nq=10, N=10, D=64, prefix=[150, 0, 70], n_real=[10, 6, 10])
    return max(compare(*args, num_splits=n) for n in (1, 2, 5))


def bf16_random_trees():
    args = make(6, B=2, Hq=6, Hkv=2, Nq=9, N=12, D=64, prefix=[40, 0], n_real=[12, 8], dtype=torch.bfloat16)
    return max(compare(*args, num_splits=n) for n in (1, 3))


def fp16_random_trees():
    args = make(7, B=2, Hq=3, Hkv=1, Nq=12, N=12, D=128, prefix=[33, 2], n_real=[12, 5], dtype=torch.float16)
    return max(compare(*args, num_splits=n) for n in (1, 3))


def head_dim_80():
    # D not a power of two: the kernel's block is padded to 128 and masked.
    return compare(*make(8, B=1, Hq=2, Hkv=1, Nq=7, N=7, D=80, prefix=[20], n_real=[7]))


def padding_only_queries_are_zero():
    q, k, v, prefix_len, parents = make(9, B=1, Hq=2, Hkv=1, Nq=3, N=10, D=64, prefix=[6], n_real=[4])
    compare(q, k, v, prefix_len, parents)
    return 0.0


def strided_cache_fp16():
    # A [B, S, Hkv, D] cache viewed as [B, Hkv, S, D]: read in place (unit stride on D only).
    q, k, v, prefix_len, parents = make(10, B=2, Hq=4, Hkv=2, Nq=6, N=6, D=64, prefix=[11, 30], n_real=[6, 4],
                                        dtype=torch.float16)
    k_t, v_t = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    assert k_t.stride(3) == 1 and not k_t.is_contiguous()
    return compare(q, k_t, v_t, prefix_len, parents)


def random_sweep():
    """Sixteen drawn configurations: shapes, ratios, dtypes, head dims, prefixes across tile edges."""
    rng = np.random.default_rng(11)
    worst = 0.0
    for seed in range(16):
        B, N = int(rng.integers(1, 4)), int(rng.integers(1, 41))
        Nq, Hkv, ratio = int(rng.integers(1, N + 1)), int(rng.integers(1, 3)), int(rng.choice([1, 3]))
        dtype = [torch.float32, torch.bfloat16, torch.float16][int(rng.integers(0, 3))]
        cfg = dict(B=B, Hq=Hkv * ratio, Hkv=Hkv, Nq=Nq, N=N, D=int(rng.choice([64, 128])),
                   prefix=[int(rng.choice([0, 1, 31, 32, 33, 100])) for _ in range(B)],
                   n_real=[int(rng.integers(1, N + 1)) for _ in range(B)],
                   shape=str(rng.choice(["random", "chain", "star"])), dtype=dtype)
        splits = [None, 1, 2, 5][int(rng.integers(0, 4))]
        try:
            worst = max(worst, compare(*make(100 + seed, **cfg), num_splits=splits))
        except AssertionError as e:
            raise AssertionError(f"config {cfg} num_splits={splits}: {e}") from e
    return worst


# ---- Invalid trees and prefix lengths (read by the plan kernel) --------------------------------


def _bad(pattern, **change):
    from poss_ext.triton_attention import tree_attention_triton

    q, k, v, prefix_len, parents = make(12, B=2, Hq=4, Hkv=2, Nq=6, N=6, D=64, prefix=[3, 0], n_real=[6, 4])
    args = dict(q=q, k_cache=k, v_cache=v, prefix_len=prefix_len, parents=parents, scale=0.125)
    for key, fn in change.items():
        args[key] = fn(args[key])
    try:
        tree_attention_triton(**args)
    except ValueError as e:
        assert re.search(pattern, str(e)), f"{e!r} does not match {pattern!r}"
        return 0.0
    raise AssertionError(f"no ValueError (expected one matching {pattern!r})")


def _set(b, i, value):
    def fn(t):
        t = t.clone()
        t[b, i] = value
        return t
    return fn


def error_root():
    return _bad(r"parents\[1, 0\] must be -1", parents=_set(1, 0, 0))


def error_parent_out_of_range():
    return _bad(r"parents\[0, 3\] = 3 must be in \[0, 3\)", parents=_set(0, 3, 3))


def error_padding_not_trailing():
    return _bad(r"parents\[1, 5\] = 0 is a real node after padding", parents=_set(1, 5, 0))


def error_general_tree_too_big():
    star = torch.tensor([[-1] + [0] * 299] * 2, dtype=torch.int32)
    return _bad(r"parents\[0\] is a general \(non-chain\) tree with 300 real nodes", parents=lambda _: star,
                k_cache=lambda _: torch.zeros(2, 2, 400, 64), v_cache=lambda _: torch.zeros(2, 2, 400, 64))


def error_prefix_negative():
    return _bad(r"prefix_len\[0\] = -1 must be >= 0", prefix_len=lambda _: torch.tensor([-1, 0], dtype=torch.int32))


def error_prefix_leaves_no_room():
    # S = 3 + 6 + 3 = 12; 7 + 6 real nodes > 12.
    return _bad(r"prefix_len\[0\] = 7 .* 6 real nodes in k_cache \(S = 12\)",
                prefix_len=lambda _: torch.tensor([7, 0], dtype=torch.int32))


CASES = {fn.__name__: fn for fn in (
    chain_causal, long_chain_past_the_mask, random_trees_gqa3_d128, star_trees_gqa1_d64, split_prefix_and_merge,
    bf16_random_trees, fp16_random_trees, head_dim_80, padding_only_queries_are_zero, strided_cache_fp16,
    random_sweep, error_root, error_parent_out_of_range, error_padding_not_trailing, error_general_tree_too_big,
    error_prefix_negative, error_prefix_leaves_no_room,
)}


# ---- Ahead-of-time compilation for CUDA targets ------------------------------------------------


def compile_for(arch: int, dtype: str, D: int):
    """Compiles the three kernels as tree_attention_triton would launch them for a verify round."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from poss_ext import triton_attention as ta

    def build(fn, sig, consts):
        sig = {**sig, **{name: "constexpr" for name in consts}}
        return triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", arch, 32))

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    block_m, block_n = ta.block_sizes(torch_dtype, D, rows=180)
    strides = {name: "i64" for name in "sq_b sq_h sq_n sk_b sk_h sk_s sv_b sv_h sv_s so_b so_h so_n".split()}
    attn = dict(q_ptr=f"*{dtype}", k_ptr=f"*{dtype}", v_ptr=f"*{dtype}", info_ptr="*i32", mask_ptr="*u8",
                out_ptr=f"*{dtype}", ws_o_ptr="*fp32", ws_ml_ptr="*fp32", **strides, Hkv="i32", G="i32",
                Nq="i32", N="i32", M="i32", chunk="i32", qk_scale="fp32")
    shared = 0
    for split in (False, True):
        k = build(ta._tree_attention_kernel, attn, dict(
            D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=split,
            PRECISION="ieee" if dtype == "fp32" else "tf32", UPCAST_BF16=False))
        shared = max(shared, k.metadata.shared)
    build(ta._merge_splits_kernel, dict(ws_o_ptr="*fp32", ws_ml_ptr="*fp32", out_ptr=f"*{dtype}", so_b="i64",
                                        so_h="i64", so_n="i64", Hkv="i32", G="i32", Nq="i32", num_splits="i32"),
          dict(D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_M=block_m))
    build(ta._plan_kernel, dict(parents_ptr="*i32", prefix_ptr="*i32", info_ptr="*i32", mask_ptr="*u8",
                                ok_ptr="*i32", N="i32", S="i32", M="i32"),
          dict(BLOCK=64, BLOCK_TREE=64, MAX_NODES=ta.MAX_TREE_NODES))
    return shared


COMPILE_CASES = {f"compile_sm{arch}_{dtype}_d{D}": (arch, dtype, D)
                 for arch, dtype, D in ((90, "bf16", 64), (80, "fp32", 64))}


def main(argv):
    if argv[:1] == ["--compile"]:
        cases = {name: (lambda a=a: compile_for(*a)) for name, a in COMPILE_CASES.items()}
        names = argv[1:] or list(cases)
    else:
        cases, names = CASES, argv or list(CASES)
    for name in names:
        try:
            detail = f"{cases[name]()}"
            ok = True
        except Exception:  # noqa: BLE001 - every failure is reported, then the next case runs
            detail, ok = traceback.format_exc(limit=4), False
        print(json.dumps({"case": name, "ok": ok, "detail": detail}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
