"""A Triton kernel of ``poss::tree_attention``, for CUDA tensors (and CPU tensors under the interpreter).

Same contract as :func:`poss_ext.ops.tree_attention`: query node ``i`` (one of the tree's last ``Nq``
nodes) attends to the cache slots ``[0, prefix_len[b])`` and to ``prefix_len[b] + j`` for ``j = i`` or
an ancestor of ``i``; padding queries are 0; scores, softmax and accumulation in float32.

Layout of the work (flash-decoding):

* One program owns ``BLOCK_M`` rows of one (request, KV head). The rows of a GQA group are node-major
  (``row = query * G + g``), as in the CUDA kernel, so every K/V tile the program loads serves all
  ``G`` query heads of the group and a tile's nodes are consecutive.
* The program walks the prefix in ``BLOCK_N``-key tiles with an online softmax (no mask: every query
  sees the whole prefix), then the tree's own slots with the ancestor mask.
* When the (request, KV head, row tile) programs alone would leave the GPU idle (small batches: a
  verify round at B = 1 has 9 of them for SmolLM2), the prefix is split into chunks across a second
  grid axis. Each split writes its unnormalised output and its softmax state (max, sum) to a
  workspace; the last split also takes the tree part; a second kernel merges the splits by
  log-sum-exp.

The tree is read once per call by a small plan kernel (:func:`plan`, one program per request): it
validates ``parents`` and ``prefix_len``, finds each request's real nodes and whether it is a chain,
and fills a ``[B, M, M]`` byte mask of ancestors, ``M = min(N, 256)``. Why precompute: a walk up the
parents inside the attention kernel would cost the tree's depth in dependent loads for every query
row and key tile; the mask costs at most 64 KiB per request (general trees have at most 256 real
nodes; a verify tree about 60) and is read as one tile per key tile. Why a kernel and not torch ops:
the same work as torch ops is some forty small launches, more than the attention itself at verify
shapes. Chains (``parents[i] = i - 1``, i.e. prefill) are causal, ``j <= i``, with no mask, so they
keep the op's unbounded length.

``import poss_ext`` does not import this module (nor triton); ``POSS_ATTENTION=triton`` does (see
``poss_ext.ops``). Set ``TRITON_INTERPRET=1`` before this module is imported to run the kernels on
CPU tensors with Triton's interpreter (that is how the tests run without a GPU).
"""

import contextlib
import functools
import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from poss_ext import limits
from poss_ext.limits import HEAD_DIMS, MAX_TREE_NODES

ROOT, PAD = tl.constexpr(limits.ROOT), tl.constexpr(limits.PAD)  # parents of the root and of padding nodes
MAX_SPLITS = 64

# Whether triton decided, when this module's kernels were decorated, to interpret them (it reads
# TRITON_INTERPRET at decoration time): only interpreted kernels can take CPU tensors.
INTERPRETED = bool(triton.knobs.runtime.interpret)

_LOG2E = 1.4426950408889634


# The plan's int32 record per request, [B, INFO_COLUMNS]: its columns.
INFO_N_REAL, INFO_CHAIN, INFO_PREFIX, INFO_ERROR, INFO_ERROR_NODE = (tl.constexpr(c) for c in range(5))
INFO_COLUMNS = tl.constexpr(5)
# Error codes of INFO_ERROR, in the order the C++ kernels check a request.
ERR_OK, ERR_ROOT, ERR_PARENT_RANGE, ERR_PADDING_NOT_TRAILING, ERR_TREE_TOO_BIG, ERR_PREFIX = (
    tl.constexpr(c) for c in range(6))


# ---- Kernels ----------------------------------------------------------------------------------


@triton.jit
def _plan_kernel(parents_ptr, prefix_ptr, info_ptr, mask_ptr, ok_ptr, N, S, M,
                 BLOCK: tl.constexpr, BLOCK_TREE: tl.constexpr, MAX_NODES: tl.constexpr):
    """One program per request: validate its tree, find n_real and whether it is a chain, clamp its
    prefix, and (general trees) fill its rows of the ancestor mask.

    Writes ``info[b] = (n_real, chain, prefix, error, error_node)`` and clears ``ok[0]`` on an error.
    """
    b = tl.program_id(0).to(tl.int64)
    row = parents_ptr + b * N
    no_node = N + tl.zeros([], tl.int32)  # a tensor even when triton specialises N == 1 to a constant

    # Pass 1: the first padding node. Node 0 is the root, never padding.
    first_pad = no_node
    for start in range(1, N, BLOCK):
        i = start + tl.arange(0, BLOCK)
        p = tl.load(row + i, mask=i < N, other=0)
        first_pad = tl.minimum(first_pad, tl.min(tl.where((i < N) & (p == PAD), i, N)))

    # Pass 2: the first real node after padding, the first parent outside [0, i), chain breaks.
    first_late = no_node
    first_range = no_node
    breaks = tl.zeros([], tl.int32)
    for start in range(1, N, BLOCK):
        i = start + tl.arange(0, BLOCK)
        p = tl.load(row + i, mask=i < N, other=PAD)
        real = p != PAD
        first_late = tl.minimum(first_late, tl.min(tl.where(real & (i > first_pad), i, N)))
        first_range = tl.minimum(first_range, tl.min(tl.where(real & ((p < 0) | (p >= i)), i, N)))
        breaks += tl.sum((real & (p != i - 1)).to(tl.int32))

    n_real = first_pad
    chain = breaks == 0
    general = breaks != 0
    root = tl.load(row)
    prefix = tl.load(prefix_ptr + b)
    bad_node = tl.minimum(first_late, first_range)
    # As scan_parents: a real node after padding is reported as such before its parent's range.
    node_err = tl.where(first_late <= first_range, ERR_PADDING_NOT_TRAILING, ERR_PARENT_RANGE)
    err = tl.where(root != ROOT, ERR_ROOT,
          tl.where(bad_node < N, node_err,
          tl.where(general & (n_real > MAX_NODES), ERR_TREE_TOO_BIG,
          tl.where((prefix < 0) | (prefix.to(tl.int64) + n_real > S), ERR_PREFIX, ERR_OK))))
    err_node = tl.where((root != ROOT) | (bad_node >= N), 0, bad_node)
    rec = info_ptr + b * INFO_COLUMNS
    tl.store(rec + INFO_N_REAL, n_real)
    tl.store(rec + INFO_CHAIN, chain.to(tl.int32))
    # Clamped like the CUDA kernel's: an invalid prefix_len still reads inside the cache.
    tl.store(rec + INFO_PREFIX, tl.maximum(tl.minimum(prefix.to(tl.int64), S - n_real), 0).to(tl.int32))
    tl.store(rec + INFO_ERROR, err)
    tl.store(rec + INFO_ERROR_NODE, err_node)
    tl.atomic_and(ok_ptr, (err == ERR_OK).to(tl.int32))

    # Ancestor mask of a general tree: every node climbs to the root in lockstep, setting one entry
    # of its row per level, so the loop runs the tree's depth (about 6 for a verify tree), not N times.
    # Parents precede their children, so the climb strictly decreases and ends even on bad input.
    n_mask = tl.where(general, tl.minimum(n_real, M), 0)
    i = tl.arange(0, BLOCK_TREE)
    par = tl.load(row + i, mask=i < n_mask, other=-1)
    cur = tl.where(i < n_mask, i, -1)
    while tl.max(cur) >= 0:
        tl.store(mask_ptr + b * M * M + i * M + cur, 1, mask=cur >= 0)
        up = tl.gather(par, tl.maximum(cur, 0), 0)
        cur = tl.where((cur >= 0) & (up >= 0) & (up < cur), up, -1)


@triton.jit
def _softmax_step(acc, m_i, l_i, s, visible, v, P_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """Folds one key tile into the rows' running softmax.

    s: ``[BLOCK_M, BLOCK_N]`` fp32 scores, already in log2 units; v: ``[BLOCK_N, BLOCK_D]`` values.
    m_i / l_i: ``[BLOCK_M]`` running max and exp2-sum; acc: ``[BLOCK_M, BLOCK_D]`` fp32, unnormalised.
    """
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; exponentiate against 0 instead so that
    # no inf - inf (NaN) is formed. Its p and alpha come out 0 and its acc stays 0.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # P is rounded to the input dtype for the tensor-core product (as FlashAttention does); fp32
    # inputs keep fp32 P and an exact fp32 product (PRECISION = "ieee"), like the CUDA kernel. The
    # second cast is a no-op except under the interpreter's bf16 workaround (see UPCAST_BF16).
    acc = acc * alpha[:, None] + tl.dot(p.to(P_DTYPE).to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, info_ptr, mask_ptr, out_ptr, ws_o_ptr, ws_ml_ptr,
    sq_b, sq_h, sq_n, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_n,
    Hkv, G, Nq, N, M, chunk, qk_scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, UPCAST_BF16: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    bh = tl.program_id(2)
    # int64: offsets like b * sk_b overflow int32 on large caches.
    b = (bh // Hkv).to(tl.int64)
    h = (bh % Hkv).to(tl.int64)
    rows = G * Nq

    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = r // G  # query index in [0, Nq)
    g = r % G
    node = N - Nq + qi  # tree node of each row
    rec = info_ptr + b * INFO_COLUMNS  # the plan's record of this request
    n_real = tl.load(rec + INFO_N_REAL)
    is_chain = tl.load(rec + INFO_CHAIN)
    chain = is_chain != 0
    general = is_chain == 0
    P = tl.load(rec + INFO_PREFIX).to(tl.int64)  # clamped into [0, S - n_real] by the plan
    live = (r < rows) & (node < n_real)  # padding rows attend to nothing and write 0

    d = tl.arange(0, BLOCK_D)
    d_ok = d < D  # D = 80, 96: the block is padded to a power of two
    q = tl.load(q_ptr + b * sq_b + (h * G + g)[:, None] * sq_h + qi[:, None] * sq_n + d[None, :],
                mask=live[:, None] & d_ok[None, :], other=0.0)
    if UPCAST_BF16:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Rows go node-major and nodes increase with rows: the tile's first node decides whether any row
    # is real, and its last row bounds the tree keys any row can see.
    first_node = N - Nq + (tile * BLOCK_M) // G
    last_node = N - Nq + (tl.minimum(tile * BLOCK_M + BLOCK_M, rows) - 1) // G
    any_live = first_node < n_real

    # The prefix: this split's chunk of [0, P), visible to every live row.
    lo = split.to(tl.int64) * chunk
    hi = tl.where(any_live, tl.minimum(P, lo + chunk), lo)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + b * sk_b + h * sk_h + n[:, None] * sk_s + d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_ptr + b * sv_b + h * sv_h + n[:, None] * sv_s + d[None, :], mask=kv_ok, other=0.0)
        if UPCAST_BF16:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, live[:, None] & n_ok[None, :], v,
                                      q_ptr.dtype.element_ty, PRECISION)

    # The tree's own slots P + j, j < min(n_real, last_node + 1): taken by the last split only.
    tree_hi = tl.where(any_live & (split == tl.num_programs(1) - 1), tl.minimum(n_real, last_node + 1), 0)
    for start in range(0, tree_hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < tree_hi
        kv_ok = j_ok[:, None] & d_ok[None, :]
        slot = P + j
        k = tl.load(k_ptr + b * sk_b + h * sk_h + slot[:, None] * sk_s + d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_ptr + b * sv_b + h * sv_h + slot[:, None] * sv_s + d[None, :], mask=kv_ok, other=0.0)
        if UPCAST_BF16:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        # Chains: causal. Other trees: the ancestor mask (nodes < M there; the bound keeps a tree that
        # broke the 256-node limit in bounds while its device assert fires).
        # `!= 0`: triton 3.9's interpreter widens this conjunction to int32, and a load's mask must be bool.
        in_mask = ((node[:, None] < M) & (j[None, :] < M) & live[:, None] & j_ok[None, :] & general) != 0
        anc = tl.load(mask_ptr + b * M * M + node[:, None] * M + j[None, :], mask=in_mask, other=0) != 0
        visible = live[:, None] & j_ok[None, :] & tl.where(chain, j[None, :] <= node[:, None], anc)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, visible, v, q_ptr.dtype.element_ty, PRECISION)

    if SPLIT:
        # Workspace rows: [splits, B * Hkv, rows]; a split that saw nothing stores m = -inf, l = 0.
        ws_row = (split.to(tl.int64) * tl.num_programs(2) + bh) * rows + r
        row_ok = r < rows
        tl.store(ws_o_ptr + ws_row[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(ws_ml_ptr + ws_row * 2, m_i, mask=row_ok)
        tl.store(ws_ml_ptr + ws_row * 2 + 1, l_i, mask=row_ok)
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows: acc = 0, so 0
        tl.store(out_ptr + b * so_b + (h * G + g)[:, None] * so_h + qi[:, None] * so_n + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=(r < rows)[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    ws_o_ptr, ws_ml_ptr, out_ptr, so_b, so_h, so_n, Hkv, G, Nq, num_splits,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """out = sum_s w_s o_s / sum_s w_s l_s with w_s = exp2(m_s - max_s m_s): the splits' log-sum-exp."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    groups = tl.num_programs(1)
    b = (bh // Hkv).to(tl.int64)
    h = (bh % Hkv).to(tl.int64)
    rows = G * Nq
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < rows
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(num_splits):
        ws_row = (s * groups + bh).to(tl.int64) * rows + r
        m = tl.maximum(m, tl.load(ws_ml_ptr + ws_row * 2, mask=row_ok, other=float("-inf")))
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros([BLOCK_M], tl.float32)
    o = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(num_splits):
        ws_row = (s * groups + bh).to(tl.int64) * rows + r
        w = tl.exp2(tl.load(ws_ml_ptr + ws_row * 2, mask=row_ok, other=float("-inf")) - m_ref)
        l += w * tl.load(ws_ml_ptr + ws_row * 2 + 1, mask=row_ok, other=0.0)
        o += w[:, None] * tl.load(ws_o_ptr + ws_row[:, None] * D + d[None, :],
                                  mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    o = o / tl.where(l > 0, l, 1.0)[:, None]  # rows that saw nothing (padding): 0
    qi = r // G
    g = r % G
    tl.store(out_ptr + b * so_b + (h * G + g)[:, None] * so_h + qi[:, None] * so_n + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# ---- Host side --------------------------------------------------------------------------------


def _shape(t: Tensor) -> str:
    return str(list(t.shape))


def check_args(q, k_cache, v_cache, prefix_len, parents, scale) -> Tuple[int, ...]:
    """Structural checks of the op's arguments (no tensor value is read): a TypeError for a wrong
    type or dtype, a ValueError for a wrong rank, size, device or scale, each naming the argument.

    Returns ``(B, Hq, Hkv, Nq, N, S, D)``.
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("prefix_len", prefix_len),
                    ("parents", parents)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D [B, Hq, Nq, D], got shape {_shape(q)}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    B, Hq, Nq, D = q.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"q.size(3) (head dim D) must be one of {', '.join(map(str, HEAD_DIMS))}, "
                         f"got shape {_shape(q)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, Hkv, S, D], got shape {_shape(t)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    if k_cache.shape[0] != B:
        raise ValueError(f"k_cache.size(0) must equal B (q.size(0)) = {B}, got shape {_shape(k_cache)}")
    if k_cache.shape[3] != D:
        raise ValueError(f"k_cache.size(3) must equal D (q.size(3)) = {D}, got shape {_shape(k_cache)}")
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"k_cache.size(1) (Hkv) must divide q.size(1) (Hq = {Hq}), got shape {_shape(k_cache)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {_shape(k_cache)}, got shape {_shape(v_cache)}")
    if prefix_len.dim() != 1:
        raise ValueError(f"prefix_len must be 1-D [B] int32, got shape {_shape(prefix_len)}")
    if prefix_len.dtype != torch.int32:
        raise TypeError(f"prefix_len must be int32, got {prefix_len.dtype}")
    if prefix_len.shape[0] != B:
        raise ValueError(f"prefix_len.size(0) must equal B (q.size(0)) = {B}, got shape {_shape(prefix_len)}")
    if parents.dim() != 2:
        raise ValueError(f"parents must be 2-D [B, N] int32, got shape {_shape(parents)}")
    if parents.dtype != torch.int32:
        raise TypeError(f"parents must be int32, got {parents.dtype}")
    if parents.shape[0] != B:
        raise ValueError(f"parents.size(0) must equal B (q.size(0)) = {B}, got shape {_shape(parents)}")
    N = parents.shape[1]
    if N < 1:
        raise ValueError(f"parents must have at least one node (the root), got shape {_shape(parents)}")
    if Nq > N:
        raise ValueError(f"q.size(2) (Nq) must be <= N = parents.size(1) = {N}, got shape {_shape(q)}")
    if N > S:
        raise ValueError(f"k_cache.size(2) (S) must be >= N = parents.size(1) = {N}, got shape {_shape(k_cache)}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("prefix_len", prefix_len), ("parents", parents)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {t.device}")
    return B, Hq, Hkv, Nq, N, S, D


def check_device(q: Tensor) -> None:
    """The kernels run on CUDA tensors, and on CPU tensors only when triton interprets them."""
    if q.is_cuda or (q.device.type == "cpu" and INTERPRETED):
        return
    if q.device.type == "cpu":
        raise ValueError(
            "q is a CPU tensor: the Triton kernel needs CUDA tensors, or CPU tensors under Triton's "
            "interpreter (TRITON_INTERPRET=1 set before poss_ext.triton_attention is imported); on the "
            "CPU, torch.ops.poss.tree_attention runs the C++ kernel")
    raise ValueError(f"q must be a CUDA tensor (or a CPU tensor under TRITON_INTERPRET=1), got {q.device}")


def _raise_value_error(info: Tensor, parents: Tensor, prefix_len: Tensor, S: int) -> None:
    """CPU tensors (the interpreter): the plan's first error as a ValueError naming the entry."""
    for b, row in enumerate(info.tolist()):
        n_real, err, node = row[INFO_N_REAL.value], row[INFO_ERROR.value], row[INFO_ERROR_NODE.value]
        if err == ERR_ROOT.value:
            raise ValueError(f"parents[{b}, 0] must be -1 (the root), got {int(parents[b, 0])}")
        if err == ERR_PARENT_RANGE.value:
            raise ValueError(f"parents[{b}, {node}] = {int(parents[b, node])} must be in [0, {node}) "
                             "(topological order) or -2 (padding)")
        if err == ERR_PADDING_NOT_TRAILING.value:
            raise ValueError(f"parents[{b}, {node}] = {int(parents[b, node])} is a real node after padding; "
                             "padding nodes (-2) must come last")
        if err == ERR_TREE_TOO_BIG.value:
            raise ValueError(f"parents[{b}] is a general (non-chain) tree with {n_real} real nodes; at most "
                             f"{MAX_TREE_NODES} are supported (chains, parents[i] = i - 1, have no limit)")
        if err == ERR_PREFIX.value:
            raise ValueError(f"prefix_len[{b}] = {int(prefix_len[b])} must be >= 0 and leave room for the "
                             f"tree's {n_real} real nodes in k_cache (S = {S})")


def plan(parents: Tensor, prefix_len: Tensor, S: int) -> Tuple[Tensor, Tensor]:
    """Reads the trees on the device: one launch, no host sync on CUDA.

    Args:
        parents: ``[B, N] int32``, contiguous; prefix_len: ``[B] int32``; S: the cache's slot count.

    Returns:
        info: ``[B, 5] int32`` per request (n_real, chain, clamped prefix_len, error code, error node).
        mask: ``[B, M, M] uint8``, ``M = min(N, 256)``: ``mask[b, i, j] = 1`` iff tree node ``j`` is
        ``i`` or an ancestor of ``i``; filled for general trees only (chains are causal).

    Invalid trees or prefix lengths raise a ValueError naming the entry on CPU tensors; on CUDA they
    trip a device-side assert (``torch._assert_async``), as the CUDA kernel's do.
    """
    B, N = parents.shape
    M = min(N, MAX_TREE_NODES)
    info = torch.empty((B, INFO_COLUMNS.value), dtype=torch.int32, device=parents.device)
    mask = torch.zeros((B, M, M), dtype=torch.uint8, device=parents.device)
    ok = torch.ones(1, dtype=torch.int32, device=parents.device)
    block = max(16, min(1024, triton.next_power_of_2(N)))
    _plan_kernel[(B,)](parents, prefix_len, info, mask, ok, N, S, M,
                       BLOCK=block, BLOCK_TREE=max(16, triton.next_power_of_2(M)), MAX_NODES=MAX_TREE_NODES)
    if parents.is_cuda:
        torch._assert_async(ok, "tree_attention (Triton): invalid parents or prefix_len "
                                "(see poss_ext.ops.tree_attention)")
    elif not bool(ok):
        _raise_value_error(info, parents, prefix_len, S)
    return info, mask


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_splits(device: torch.device, programs: int, S: int, block_n: int) -> int:
    """Prefix splits: enough programs for two waves over the SMs, chunks of at least 4 key tiles.

    Chunks cover ``[0, S)`` because prefix_len stays on the device (splits past a short prefix exit
    at once). One split on the CPU (the interpreter runs programs one after another).
    """
    if device.type != "cuda":
        return 1
    target = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, programs), triton.cdiv(S, 4 * block_n), MAX_SPLITS))


def block_sizes(dtype: torch.dtype, D: int, rows: int) -> Tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)``: rows per program and keys per tile.

    bf16 / fp16 tiles go through the tensor cores; fp32 ones are exact FMA products, which stage
    their operands in shared memory in fp32: smaller tiles keep D = 256 under an A100's 164 KiB
    (measured by compiling for sm_80 / sm_90 with triton 3.8: 100 KiB at D = 256).
    """
    if dtype == torch.float32:
        return max(16, min(32, triton.next_power_of_2(rows))), 32 if D <= 128 else 16
    return max(16, min(64, triton.next_power_of_2(rows))), 64 if D <= 128 else 32


def tree_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, prefix_len: Tensor, parents: Tensor,
                          scale: float, *, num_splits: Optional[int] = None) -> Tensor:
    """``poss::tree_attention`` with Triton kernels; the contract of :func:`poss_ext.ops.tree_attention`.

    Args:
        q: ``[B, Hq, Nq, D]`` float32 / bfloat16 / float16, the queries of tree nodes ``N - Nq .. N - 1``;
            ``D`` in {64, 80, 96, 128, 256}.
        k_cache: ``[B, Hkv, S, D]``, q's dtype, ``Hq % Hkv == 0``; the tree's keys at slots
            ``prefix_len[b] + i``. Read in place when the stride of ``D`` is 1.
        v_cache: ``[B, Hkv, S, D]``, like ``k_cache``.
        prefix_len: ``[B] int32``; ``prefix_len[b] + n_real <= S``.
        parents: ``[B, N] int32``, the shared tree encoding; chains of any length, other trees at most
            256 real nodes.
        scale: softmax scale, finite and > 0.
        num_splits: prefix splits (split-K) per row tile; None picks them from the GPU's SM count. The
            tests set it to exercise the merge.

    Returns:
        ``[B, Hq, Nq, D]``, q's dtype, contiguous. Padding queries are 0. Scores, softmax and the
        accumulator are float32; for bf16 / fp16 inputs the probabilities are rounded to the input
        dtype for the P @ V product (FlashAttention does the same; the CUDA kernel keeps them fp32).

    Raises:
        TypeError / ValueError: a wrong type, dtype, rank, size, device or scale (before any launch); a
        CPU tensor when the kernels are not interpreted; on CPU tensors, an invalid tree or prefix_len.
        On CUDA an invalid tree or prefix_len trips a device-side assert instead (no host sync).
    """
    B, Hq, Hkv, Nq, N, S, D = check_args(q, k_cache, v_cache, prefix_len, parents, scale)
    check_device(q)
    if num_splits is not None and not (isinstance(num_splits, int) and num_splits >= 1):
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        q = q if q.stride(3) == 1 else q.contiguous()
        k = k_cache if k_cache.stride(3) == 1 else k_cache.contiguous()
        v = v_cache if v_cache.stride(3) == 1 else v_cache.contiguous()
        info, mask = plan(parents.contiguous(), prefix_len.contiguous(), S)
        M = mask.shape[1]

        G = Hq // Hkv
        rows = G * Nq
        block_m, block_n = block_sizes(q.dtype, D, rows)
        block_d = triton.next_power_of_2(D)
        tiles, groups = triton.cdiv(rows, block_m), B * Hkv
        splits = num_splits or default_splits(q.device, tiles * groups, S, block_n)
        chunk = triton.cdiv(triton.cdiv(S, splits), block_n) * block_n  # whole key tiles per split
        splits = triton.cdiv(S, chunk)  # no split starts past S; the last one takes the tree part
        # Triton's interpreter multiplies bf16 dot operands as raw bits (triton-lang/triton#11584, not
        # supported there yet): interpreted bf16 runs its products in fp32 on the bf16 values, which
        # is what the tensor cores compute too (bf16 x bf16 products are exact in fp32).
        upcast = INTERPRETED and q.dtype == torch.bfloat16
        precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"  # fp32: exact, as the CUDA op
        if splits > 1:
            ws_o = torch.empty((splits, groups, rows, D), dtype=torch.float32, device=q.device)
            ws_ml = torch.empty((splits, groups, rows, 2), dtype=torch.float32, device=q.device)
        else:
            ws_o = ws_ml = out  # unused: SPLIT=False writes the output directly
        _tree_attention_kernel[(tiles, splits, groups)](
            q, k, v, info, mask, out, ws_o, ws_ml,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            Hkv, G, Nq, N, M, chunk, float(scale) * _LOG2E,
            D=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=splits > 1, PRECISION=precision,
            UPCAST_BF16=upcast,
        )
        if splits > 1:
            _merge_splits_kernel[(tiles, groups)](
                ws_o, ws_ml, out, out.stride(0), out.stride(1), out.stride(2), Hkv, G, Nq, splits,
                D=D, BLOCK_D=block_d, BLOCK_M=block_m,
            )
    return out
