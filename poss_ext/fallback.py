"""The compiled kernels' argument checks, in Python, for the references that serve a device without them.

A reference reads what it is given: a negative token id indexes from the end, a parent of -3 or a
negative scale goes through. When ``poss_ext`` was built without CUDA kernels, :func:`checked` puts
these checks in front of each reference before it is registered for CUDA, so a bad call fails as it
would on a kernel: the same checks in the same order (``csrc/include/poss/*_args.h``, then the CPU
kernels' value checks), with the same messages. The references stay unchecked as test oracles.
"""

import functools
import math
from typing import Callable, List, Optional

import torch
from torch import Tensor

from poss_ext import reference
from poss_ext.limits import EMPTY_CANDIDATE, HEAD_DIMS, MAX_TREE_NODES, PAD, ROOT

INT32_MAX = 2**31 - 1


def _fail(msg: str):
    raise RuntimeError(msg)


# ---- csrc/include/poss/arg_checks.h: the same words as c10 prints them -------------------------


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype: torch.dtype) -> str:
    """c10's name of a dtype (``Float``, ``Long``, ``BFloat16``), as the C++ messages print it."""
    try:
        return torch.empty(0, dtype=dtype).type()[len("torch."):-len("Tensor")]
    except (RuntimeError, TypeError):
        return str(dtype).replace("torch.", "")


def _shape(t: Tensor) -> str:
    return str(list(t.shape))


def _num(x: float) -> str:
    return f"{x:g}"  # an ostream's default float format


def check_dtype(t: Tensor, name: str, want: torch.dtype) -> None:
    if t.dtype != want:
        _fail(f"{name} must be {_dtype_name(want)}, got {_dtype_name(t.dtype)}")


def check_dim(t: Tensor, name: str, dim: int, layout: str) -> None:
    if t.dim() != dim:
        _fail(f"{name} must be {dim}-D {layout}, got shape {_shape(t)}")


def check_size(t: Tensor, name: str, d: int, want: int, what: str) -> None:
    if t.size(d) != want:
        _fail(f"{name}.size({d}) must equal {what} = {want}, got shape {_shape(t)}")


def check_same_device(t: Tensor, name: str, ref: Tensor, ref_name: str) -> None:
    if t.device != ref.device:
        _fail(f"{name} must be on the same device as {ref_name} ({ref.device}), got {t.device}")


def check_float_dtype(t: Tensor, name: str) -> None:
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        _fail(f"{name} must be float32, bfloat16 or float16, got {_dtype_name(t.dtype)}")


# ---- ATen/MemoryOverlap.h ---------------------------------------------------------------------


def _non_overlapping_and_dense(t: Tensor) -> bool:
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _has_internal_overlap(t: Tensor) -> bool:
    """at::has_internal_overlap(t) == MemOverlap::Yes: a stride-0 dimension of size > 1."""
    if _non_overlapping_and_dense(t):
        return False
    return any(n > 1 and s == 0 for n, s in zip(t.shape, t.stride()))


def _share_memory(a: Tensor, b: Tensor) -> bool:
    """at::get_overlap_status(a, b) is Full or Partial."""
    if a is b:
        return True
    if a.numel() == 0 or b.numel() == 0:
        return False
    if not (_non_overlapping_and_dense(a) and _non_overlapping_and_dense(b)):
        return False  # TooHard: ATen does not decide, neither do the kernels
    if a.device != b.device or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def check_no_internal_overlap(t: Tensor, name: str) -> None:
    if _has_internal_overlap(t):
        _fail(f"{name} must not have internal memory overlap (e.g. an expanded tensor), got strides "
              f"{list(t.stride())}")


# ---- poss/tree.h and poss/tree_checks.h -------------------------------------------------------


def check_tree(parents_row: List[int], b: int, tokens_row: Optional[List[int]] = None, vocab: int = 0):
    """scan_parents (+ validate_tree's token range when tokens_row is given) and check_tree_scan.

    Returns (n_real, chain)."""
    n = len(parents_row)
    if n < 1 or parents_row[0] != ROOT:
        _fail(f"parents[{b}, 0] must be -1 (the root), got {parents_row[0]}")
    n_real, chain, padding = 1, True, False
    for i in range(1, n):
        p = parents_row[i]
        if p == PAD:
            padding = True
            continue
        if padding:
            _fail(f"parents[{b}, {i}] = {p} is a real node after padding; padding nodes (-2) must come last")
        if p < 0 or p >= i:
            _fail(f"parents[{b}, {i}] = {p} must be in [0, {i}) (topological order) or -2 (padding)")
        chain = chain and p == i - 1
        n_real = i + 1
    if tokens_row is not None:
        for i in range(n_real):
            if not 0 <= tokens_row[i] < vocab:
                _fail(f"tokens[{b}, {i}] = {tokens_row[i]} must be in [0, {vocab}) (the vocabulary of logits)")
    return n_real, chain


# ---- tree_verify: poss/tree_verify_args.h, csrc/cpu/tree_verify.cpp ----------------------------


def check_tree_verify(parents, tokens, logits, temperature=None, top_k=None, top_p=None, uniforms=None,
                      min_p=None) -> None:
    check_dim(parents, "parents", 2, "[B, N] int32")
    check_dtype(parents, "parents", torch.int32)
    B, N = parents.shape
    if N < 1:
        _fail(f"parents must have at least one node (the root), got shape {_shape(parents)}")
    check_dim(tokens, "tokens", 2, "[B, N] int64")
    check_dtype(tokens, "tokens", torch.int64)
    check_size(tokens, "tokens", 0, B, "B (parents.size(0))")
    check_size(tokens, "tokens", 1, N, "N (parents.size(1))")
    check_dim(logits, "logits", 3, "[B, N, V]")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        _fail(f"logits must be float32, bfloat16 or float16, got {_dtype_name(logits.dtype)}")
    check_size(logits, "logits", 0, B, "B (parents.size(0))")
    check_size(logits, "logits", 1, N, "N (parents.size(1))")
    V = logits.size(2)
    if V < 1:
        _fail(f"logits must have a vocabulary of at least 1, got shape {_shape(logits)}")
    check_same_device(tokens, "tokens", parents, "parents")
    check_same_device(logits, "logits", parents, "parents")
    for t, name, dtype in ((temperature, "temperature", torch.float32), (top_k, "top_k", torch.int32),
                           (top_p, "top_p", torch.float32), (min_p, "min_p", torch.float32)):
        if t is not None:
            check_dim(t, name, 1, "[B]")
            check_dtype(t, name, dtype)
            check_size(t, name, 0, B, "B (parents.size(0))")
            check_same_device(t, name, parents, "parents")
    if uniforms is not None:
        check_dim(uniforms, "uniforms", 2, "[B, N+1] float32")
        check_dtype(uniforms, "uniforms", torch.float32)
        check_size(uniforms, "uniforms", 0, B, "B (parents.size(0))")
        check_size(uniforms, "uniforms", 1, N + 1, "N + 1")
        check_same_device(uniforms, "uniforms", parents, "parents")
    elif temperature is not None and bool((temperature > 0).any()):
        _fail("uniforms ([B, N+1] float32 in [0, 1)) is required when any temperature > 0")

    par, tok = parents.tolist(), tokens.tolist()
    for b in range(B):
        check_tree(par[b], b, tok[b], V)
    temp = [0.0] * B if temperature is None else temperature.tolist()
    k = [0] * B if top_k is None else top_k.tolist()
    p = [1.0] * B if top_p is None else top_p.tolist()
    mp = [0.0] * B if min_p is None else min_p.tolist()
    for b in range(B):
        if not (math.isfinite(temp[b]) and temp[b] >= 0.0):
            _fail(f"temperature[{b}] = {_num(temp[b])} must be finite and >= 0 (0 = greedy)")
        if not k[b] >= 0:
            _fail(f"top_k[{b}] = {k[b]} must be >= 0 (0 = off)")
        if not (p[b] > 0.0 and p[b] <= 1.0):
            _fail(f"top_p[{b}] = {_num(p[b])} must be in (0, 1] (1 = off)")
        if not (mp[b] >= 0.0 and mp[b] <= 1.0):
            _fail(f"min_p[{b}] = {_num(mp[b])} must be in [0, 1] (0 = off)")
    if uniforms is not None:
        for i, u in enumerate(uniforms.flatten().tolist()):
            if not (u >= 0.0 and u < 1.0):
                _fail(f"uniforms[{i // (N + 1)}, {i % (N + 1)}] = {_num(u)} must be in [0, 1)")


# ---- build_tree: poss/build_tree_args.h, csrc/cpu/build_tree.cpp -------------------------------


def check_build_tree(cand_tokens, cand_scores, cand_parents, root_token, num_nodes) -> None:
    check_dim(cand_tokens, "cand_tokens", 2, "[B, M] int64")
    check_dtype(cand_tokens, "cand_tokens", torch.int64)
    B, M = cand_tokens.shape
    for t, name, layout, dtype in ((cand_scores, "cand_scores", "[B, M] float32", torch.float32),
                                   (cand_parents, "cand_parents", "[B, M] int32", torch.int32)):
        check_dim(t, name, 2, layout)
        check_dtype(t, name, dtype)
        check_size(t, name, 0, B, "B (cand_tokens.size(0))")
        check_size(t, name, 1, M, "M (cand_tokens.size(1))")
    check_dim(root_token, "root_token", 1, "[B] int64")
    check_dtype(root_token, "root_token", torch.int64)
    check_size(root_token, "root_token", 0, B, "B (cand_tokens.size(0))")
    check_same_device(cand_scores, "cand_scores", cand_tokens, "cand_tokens")
    check_same_device(cand_parents, "cand_parents", cand_tokens, "cand_tokens")
    check_same_device(root_token, "root_token", cand_tokens, "cand_tokens")
    if num_nodes < 1:
        _fail(f"num_nodes must be >= 1 (the root counts), got {num_nodes}")
    if num_nodes > INT32_MAX:
        _fail(f"num_nodes must fit in int32, got {num_nodes}")
    if M >= INT32_MAX:
        _fail(f"cand_tokens.size(1) (M) must fit in int32, got {M}")

    par, sc = cand_parents.tolist(), cand_scores.tolist()
    for b in range(B):
        for i in range(M):
            p = par[b][i]
            if p == EMPTY_CANDIDATE:
                continue
            if p < -1 or p >= i:
                _fail(f"cand_parents[{b}, {i}] = {p} must be in [-1, {i}) (-1 = child of the root, else an "
                      "earlier candidate) or -2 (empty slot)")
            if p >= 0 and par[b][p] == EMPTY_CANDIDATE:
                _fail(f"cand_parents[{b}, {i}] = {p} points to an empty candidate slot (its parent is -2)")
            if math.isnan(sc[b][i]):
                _fail(f"cand_scores[{b}, {i}] is NaN; scores must be comparable")


# ---- tree_attention: poss/tree_attention_args.h, csrc/cpu/tree_attention.cpp -------------------


def check_tree_attention(q, k_cache, v_cache, prefix_len, parents, scale) -> None:
    check_dim(q, "q", 4, "[B, Hq, Nq, D]")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        _fail(f"q must be float32, bfloat16 or float16, got {_dtype_name(q.dtype)}")
    B, Hq, Nq, D = q.shape
    if D not in HEAD_DIMS:
        _fail(f"q.size(3) (head dim D) must be one of {', '.join(map(str, HEAD_DIMS))}, got shape {_shape(q)}")
    check_dim(k_cache, "k_cache", 4, "[B, Hkv, S, D]")
    check_dtype(k_cache, "k_cache", q.dtype)
    check_size(k_cache, "k_cache", 0, B, "B (q.size(0))")
    check_size(k_cache, "k_cache", 3, D, "D (q.size(3))")
    Hkv, S = k_cache.size(1), k_cache.size(2)
    if not (Hkv >= 1 and Hq % Hkv == 0):
        _fail(f"k_cache.size(1) (Hkv) must divide q.size(1) (Hq = {Hq}), got shape {_shape(k_cache)}")
    check_dim(v_cache, "v_cache", 4, "[B, Hkv, S, D]")
    check_dtype(v_cache, "v_cache", q.dtype)
    if v_cache.shape != k_cache.shape:
        _fail(f"v_cache must have the shape of k_cache {_shape(k_cache)}, got shape {_shape(v_cache)}")
    check_dim(prefix_len, "prefix_len", 1, "[B] int32")
    check_dtype(prefix_len, "prefix_len", torch.int32)
    check_size(prefix_len, "prefix_len", 0, B, "B (q.size(0))")
    check_dim(parents, "parents", 2, "[B, N] int32")
    check_dtype(parents, "parents", torch.int32)
    check_size(parents, "parents", 0, B, "B (q.size(0))")
    N = parents.size(1)
    if N < 1:
        _fail(f"parents must have at least one node (the root), got shape {_shape(parents)}")
    if Nq > N:
        _fail(f"q.size(2) (Nq) must be <= N = parents.size(1) = {N}, got shape {_shape(q)}")
    if N > S:
        _fail(f"k_cache.size(2) (S) must be >= N = parents.size(1) = {N}, got shape {_shape(k_cache)}")
    if not (math.isfinite(scale) and scale > 0.0):
        _fail(f"scale must be finite and > 0, got {_num(scale)}")
    check_same_device(k_cache, "k_cache", q, "q")
    check_same_device(v_cache, "v_cache", q, "q")
    check_same_device(prefix_len, "prefix_len", q, "q")
    check_same_device(parents, "parents", q, "q")

    par, pl = parents.tolist(), prefix_len.tolist()
    for b in range(B):
        n_real, chain = check_tree(par[b], b)
        if not (chain or n_real <= MAX_TREE_NODES):
            _fail(f"parents[{b}] is a general (non-chain) tree with {n_real} real nodes; at most "
                  f"{MAX_TREE_NODES} are supported (chains, parents[i] = i - 1, have no limit)")
        if not (pl[b] >= 0 and pl[b] + n_real <= S):
            _fail(f"prefix_len[{b}] = {pl[b]} must be >= 0 and leave room for the tree's {n_real} real nodes "
                  f"in k_cache (S = {S})")


# ---- kv_compact: poss/kv_compact_args.h, poss/kv_compact.h -------------------------------------


def check_kv_compact(k_cache, v_cache, prefix_len, accept_nodes, accept_len) -> None:
    check_dim(k_cache, "k_cache", 5, "[L, B, Hkv, S, D]")
    if not k_cache.dtype.is_floating_point:
        _fail(f"k_cache must be a floating dtype (float32, bfloat16, float16), got {_dtype_name(k_cache.dtype)}")
    if v_cache.shape != k_cache.shape:
        _fail(f"v_cache must have k_cache's shape {_shape(k_cache)}, got {_shape(v_cache)}")
    if v_cache.dtype != k_cache.dtype:
        _fail(f"v_cache must have k_cache's dtype {_dtype_name(k_cache.dtype)}, got {_dtype_name(v_cache.dtype)}")
    check_same_device(v_cache, "v_cache", k_cache, "k_cache")
    for t, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if not (t.size(4) <= 1 or t.stride(4) == 1):
            _fail(f"{name} must be contiguous in its last (D) dimension, got strides {list(t.stride())}")
    check_no_internal_overlap(k_cache, "k_cache")
    check_no_internal_overlap(v_cache, "v_cache")
    if _share_memory(k_cache, v_cache):
        _fail("v_cache must not share memory with k_cache")
    B, S = k_cache.size(1), k_cache.size(3)
    check_dim(prefix_len, "prefix_len", 1, "[B] int32")
    check_dtype(prefix_len, "prefix_len", torch.int32)
    check_size(prefix_len, "prefix_len", 0, B, "B (k_cache.size(1))")
    check_dim(accept_nodes, "accept_nodes", 2, "[B, N] int32")
    check_dtype(accept_nodes, "accept_nodes", torch.int32)
    check_size(accept_nodes, "accept_nodes", 0, B, "B (k_cache.size(1))")
    if accept_nodes.size(1) < 1:
        _fail(f"accept_nodes must have at least one column (the root), got shape {_shape(accept_nodes)}")
    check_dim(accept_len, "accept_len", 1, "[B] int32")
    check_dtype(accept_len, "accept_len", torch.int32)
    check_size(accept_len, "accept_len", 0, B, "B (k_cache.size(1))")
    check_same_device(prefix_len, "prefix_len", k_cache, "k_cache")
    check_same_device(accept_nodes, "accept_nodes", k_cache, "k_cache")
    check_same_device(accept_len, "accept_len", k_cache, "k_cache")

    N = accept_nodes.size(1)
    pre, nodes, lens = prefix_len.tolist(), accept_nodes.tolist(), accept_len.tolist()
    for b in range(B):
        a, n = nodes[b], lens[b]
        if not 0 <= n < N:
            _fail(f"accept_len[{b}] = {n} must be in [0, {N}) (accepted draft tokens; accept_nodes holds the "
                  "root plus that many)")
        if pre[b] < 0:
            _fail(f"prefix_len[{b}] = {pre[b]} must be >= 0")
        for j in range(n + 1):
            if j == 0 and a[0] < 0:
                _fail(f"accept_nodes[{b}, 0] = {a[0]} must be >= 0")
            if j > 0 and a[j] <= a[j - 1]:
                _fail(f"accept_nodes[{b}, {j}] = {a[j]} must be greater than accept_nodes[{b}, {j - 1}] = "
                      f"{a[j - 1]} (a root-to-leaf path in topological order is strictly increasing)")
            if a[j] >= N:
                _fail(f"accept_nodes[{b}, {j}] = {a[j]} must be < N = {N}")
            if pre[b] + a[j] >= S:
                _fail(f"prefix_len[{b}] + accept_nodes[{b}, {j}] = {pre[b] + a[j]} must be < S = {S} "
                      "(k_cache.size(3))")


# ---- decoder-layer ops: poss/linear_args.h, poss/layer_args.h, csrc/cpu/layer_ops.cpp ----------


def check_linear(x, weight, bias=None, residual=None) -> None:
    if not x.dtype.is_floating_point:
        _fail(f"x must be float32, bfloat16 or float16, got {_dtype_name(x.dtype)}")
    if x.dim() < 1:
        _fail("x must be [..., K], got a 0-D tensor")
    check_dim(weight, "weight", 2, "[N, K]")
    check_size(weight, "weight", 1, x.size(-1), "x.size(-1) (K)")
    check_dtype(weight, "weight", x.dtype)
    check_same_device(weight, "weight", x, "x")
    N = weight.size(0)
    if bias is not None:
        check_dim(bias, "bias", 1, "[N]")
        check_size(bias, "bias", 0, N, "weight.size(0) (N)")
        check_dtype(bias, "bias", x.dtype)
        check_same_device(bias, "bias", x, "x")
    if residual is not None:
        want = [*x.shape[:-1], N]
        if list(residual.shape) != want:
            _fail(f"residual must be [..., N] = {want}, got shape {_shape(residual)}")
        check_dtype(residual, "residual", x.dtype)
        check_same_device(residual, "residual", x, "x")


def check_rms_norm(x, weight, eps) -> None:
    check_float_dtype(x, "x")
    if x.dim() < 1:
        _fail("x must have at least 1 dimension, got a scalar")
    check_dim(weight, "weight", 1, "[H]")
    check_size(weight, "weight", 0, x.size(-1), "x.size(-1)")
    check_dtype(weight, "weight", x.dtype)
    check_same_device(weight, "weight", x, "x")


def check_add_rms_norm(x, residual, weight, eps) -> None:
    check_rms_norm(x, weight, eps)
    if residual.shape != x.shape:
        _fail(f"residual must have x's shape {_shape(x)}, got {_shape(residual)}")
    check_dtype(residual, "residual", x.dtype)
    check_same_device(residual, "residual", x, "x")


def check_swiglu(gate_up) -> None:
    check_float_dtype(gate_up, "gate_up")
    if not (gate_up.dim() >= 1 and gate_up.size(-1) % 2 == 0):
        _fail(f"gate_up must be [..., 2F] (gate then up), got shape {_shape(gate_up)}")


def check_rope_qkv(qkv, positions, inv_freq, k_cache, v_cache, start, num_heads, num_kv_heads) -> None:
    check_float_dtype(qkv, "qkv")
    check_dim(qkv, "qkv", 3, "[B, T, (Hq + 2 Hkv) D]")
    if not (num_heads > 0 and num_kv_heads > 0 and num_heads % num_kv_heads == 0):
        _fail(f"num_heads must be a positive multiple of num_kv_heads, got {num_heads} and {num_kv_heads}")
    check_dim(k_cache, "k_cache", 4, "[B, Hkv, S, D]")
    B, T, D = qkv.size(0), qkv.size(1), k_cache.size(3)
    if D % 2 != 0:
        _fail(f"k_cache head dim must be even for RoPE, got {D}")
    check_size(qkv, "qkv", 2, (num_heads + 2 * num_kv_heads) * D, "(num_heads + 2 num_kv_heads) * D")
    check_dtype(k_cache, "k_cache", qkv.dtype)
    check_size(k_cache, "k_cache", 0, B, "B")
    check_size(k_cache, "k_cache", 1, num_kv_heads, "num_kv_heads")
    if v_cache.shape != k_cache.shape:
        _fail(f"v_cache must have k_cache's shape {_shape(k_cache)}, got {_shape(v_cache)}")
    check_dtype(v_cache, "v_cache", qkv.dtype)
    check_no_internal_overlap(k_cache, "k_cache")
    check_no_internal_overlap(v_cache, "v_cache")
    if _share_memory(k_cache, v_cache):
        _fail("v_cache must not share memory with k_cache")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        _fail("k_cache and v_cache must be contiguous")
    check_dtype(positions, "positions", torch.int64)
    check_dim(positions, "positions", 2, "[B, T]")
    check_size(positions, "positions", 0, B, "B")
    check_size(positions, "positions", 1, T, "T")
    check_dtype(inv_freq, "inv_freq", torch.float32)
    check_dim(inv_freq, "inv_freq", 1, "[D / 2]")
    check_size(inv_freq, "inv_freq", 0, D // 2, "D / 2")
    check_dtype(start, "start", torch.int32)
    check_dim(start, "start", 1, "[B]")
    check_size(start, "start", 0, B, "B")
    for t, name in ((positions, "positions"), (inv_freq, "inv_freq"), (k_cache, "k_cache"),
                    (v_cache, "v_cache"), (start, "start")):
        check_same_device(t, name, qkv, "qkv")

    S = k_cache.size(2)
    for b, s in enumerate(start.tolist()):
        if not (s >= 0 and s + T <= S):
            _fail(f"start[{b}] + T must lie within the cache (S = {S}), got start = {s}, T = {T}")


CHECKS = {
    "tree_verify": check_tree_verify,
    "build_tree": check_build_tree,
    "tree_attention": check_tree_attention,
    "kv_compact": check_kv_compact,
    "linear": check_linear,
    "rms_norm": check_rms_norm,
    "add_rms_norm": check_add_rms_norm,
    "swiglu": check_swiglu,
    "rope_qkv": check_rope_qkv,
}


def checked(name: str) -> Callable:
    """poss_ext.reference.<name> behind the kernels' argument checks: what ``_register_fallbacks``
    serves on a device without compiled kernels."""
    check, ref = CHECKS[name], getattr(reference, name)

    @functools.wraps(ref)
    def fallback(*args, **kwargs):
        check(*args, **kwargs)
        return ref(*args, **kwargs)

    return fallback
