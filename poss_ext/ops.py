"""Typed Python wrappers of the poss ops, with their fake (meta) kernels.

Tree encoding shared by every op: per request ``b``, ``N`` nodes in topological order. Node 0 is
the root (the last committed token); ``parents[b, 0] = -1``, ``0 <= parents[b, i] < i`` for real
nodes, and padding nodes carry ``-2`` after the real ones.
"""

import os
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from poss_ext import fallback

# ---- Tree verification (greedy and exact sampling) --------------------------------------------


def tree_verify(
    parents: Tensor,
    tokens: Tensor,
    logits: Tensor,
    temperature: Optional[Tensor] = None,
    top_k: Optional[Tensor] = None,
    top_p: Optional[Tensor] = None,
    uniforms: Optional[Tensor] = None,
    min_p: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Accept the longest valid path of a draft tree against the target's logits.

    Args:
        parents: ``[B, N] int32``, the tree (shared encoding above).
        tokens: ``[B, N] int64``; ``tokens[b, 0]`` is the root token.
        logits: ``[B, N, V]`` float32 / bfloat16 / float16, the target's logits at each node
            (they predict the node's children).
        temperature: ``[B] float32``; ``None`` or 0 for a request means greedy.
        top_k: ``[B] int32``, 0 = off.
        top_p: ``[B] float32``, 1.0 = off.
        uniforms: ``[B, N + 1] float32`` in ``[0, 1)``; ``uniforms[b, i]`` decides node ``i``,
            ``uniforms[b, N]`` draws the next token. Required when any temperature > 0.
        min_p: ``[B] float32`` in ``[0, 1]``, 0 = off.

    Returns:
        accept_nodes: ``[B, N] int32``, node ids of the accepted path, root first, then -1.
        accept_len: ``[B] int32``, accepted draft tokens (root not counted).
        next_token: ``[B] int64``, the bonus / correction token after the accepted path.

    Greedy descends to the first child (node order) whose token is the argmax (lowest id on ties);
    greedy requests ignore top_k, top_p and min_p.

    Sampling is exact for deterministic drafts. The target's distribution p at a node is processed
    in Hugging Face's order, each step on the survivors of the previous one, then renormalised:

    1. temperature: ``softmax(logits / T)``;
    2. top-k: keep the tokens whose logit is >= the k-th largest (ties kept);
    3. top-p: keep the smallest set of most likely tokens whose mass reaches top_p (ties with the
       last one kept);
    4. min-p: keep the tokens with ``p(x) >= min_p * max p`` (the threshold rounded to float32).

    Child x is accepted when ``u < p(x) / remaining mass``, a rejected child's mass is removed, and
    the next token is drawn from what remains (or from p itself at a leaf).
    """
    return torch.ops.poss.tree_verify(parents, tokens, logits, temperature, top_k, top_p, uniforms, min_p)


def _check_same_device(ref: Tensor, **tensors: Optional[Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None:
            torch._check(
                t.device == ref.device,
                lambda name=name, t=t: f"{name} must be on the same device as parents ({ref.device}), got {t.device}",
            )


@torch.library.register_fake("poss::tree_verify")
def _tree_verify_fake(parents, tokens, logits, temperature=None, top_k=None, top_p=None, uniforms=None,
                      min_p=None):
    torch._check(parents.dim() == 2, lambda: "parents must be [B, N] int32")
    _check_same_device(parents, tokens=tokens, logits=logits, temperature=temperature, top_k=top_k,
                       top_p=top_p, uniforms=uniforms, min_p=min_p)
    B, N = parents.shape
    return (
        parents.new_empty((B, N), dtype=torch.int32),
        parents.new_empty((B,), dtype=torch.int32),
        parents.new_empty((B,), dtype=torch.int64),
    )


# ---- Tree building ----------------------------------------------------------------------------


def build_tree(
    cand_tokens: Tensor,
    cand_scores: Tensor,
    cand_parents: Tensor,
    root_token: Tensor,
    num_nodes: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Assemble the EAGLE-2 dynamic draft tree from the draft's candidate beam, on the device.

    Args:
        cand_tokens: ``[B, M] int64``, the token of each candidate.
        cand_scores: ``[B, M] float32``, cumulative draft log-prob of each candidate's path.
            NaN is an error.
        cand_parents: ``[B, M] int32``, ``-1`` = child of the root, else the index ``j < i`` of
            the parent candidate; ``-2`` = empty slot (no candidate; lets requests have different
            candidate counts).
        root_token: ``[B] int64``, the last committed token (node 0).
        num_nodes: tree size including the root, ``>= 1``.

    Returns:
        tokens: ``[B, num_nodes] int64``; padding nodes hold 0.
        parents: ``[B, num_nodes] int32`` in the shared encoding (root -1, padding -2).
        depth: ``[B, num_nodes] int32``; root 0, a child of the root 1; padding nodes 0.

    Selection rule: rank the candidates by ``path_min`` (the lowest score on the path from the
    root's child down to the candidate) descending, then by candidate index ascending, and keep
    the first ``min(num_nodes - 1, #candidates)``, ordered by candidate index behind the root.
    The result is always closed under ancestors (a parent ranks strictly ahead of its child). For
    EAGLE-2's candidates (cumulative log-probs never increase along a path) ``path_min`` is the
    score itself, so this is EAGLE-2's top-``T`` selection with ties broken toward the lower index.

    Invalid values (a parent outside ``[-1, i)``, a parent that is an empty slot, a NaN score)
    raise a RuntimeError on the CPU and trip a device-side assert on CUDA (no host sync). The CUDA
    kernel keeps a request's candidates in shared memory: ``M <= 2048``.
    """
    return torch.ops.poss.build_tree(cand_tokens, cand_scores, cand_parents, root_token, num_nodes)


@torch.library.register_fake("poss::build_tree")
def _build_tree_fake(cand_tokens, cand_scores, cand_parents, root_token, num_nodes):
    torch._check(cand_tokens.dim() == 2, lambda: "cand_tokens must be [B, M] int64")
    torch._check(num_nodes >= 1, lambda: f"num_nodes must be >= 1, got {num_nodes}")
    B = cand_tokens.shape[0]
    return (
        cand_tokens.new_empty((B, num_nodes), dtype=torch.int64),
        cand_tokens.new_empty((B, num_nodes), dtype=torch.int32),
        cand_tokens.new_empty((B, num_nodes), dtype=torch.int32),
    )


# ---- Tree attention ---------------------------------------------------------------------------


def tree_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    prefix_len: Tensor,
    parents: Tensor,
    scale: float,
) -> Tensor:
    """Attention of the last ``Nq`` nodes of a draft tree over a KV cache prefix and their ancestors.

    Args:
        q: ``[B, Hq, Nq, D]`` float32 / bfloat16 / float16, the queries of tree nodes
            ``N - Nq .. N - 1`` (``Nq = N`` to verify a whole tree; ``Nq < N`` for a draft level
            that queries only its newest nodes). ``D`` in {64, 80, 96, 128, 256}.
        k_cache: ``[B, Hkv, S, D]``, same dtype; ``Hq`` must be a multiple of ``Hkv`` (GQA). The
            tree's own keys are already written at slots ``prefix_len[b] + i``. Any strides with a
            unit stride on ``D`` are read in place.
        v_cache: ``[B, Hkv, S, D]``, like ``k_cache``.
        prefix_len: ``[B] int32``, committed prefix length; ``prefix_len[b] + n_real <= S``.
        parents: ``[B, N] int32``, the tree (shared encoding). A chain (``parents[i] = i - 1``)
            is causal attention and may have any length; other trees at most 256 real nodes.
        scale: softmax scale, usually ``D ** -0.5``.

    Returns:
        ``[B, Hq, Nq, D]``, q's dtype. Query node ``i`` attends to slots ``[0, prefix_len[b])`` and
        to ``prefix_len[b] + j`` for ``j`` = ``i`` or an ancestor of ``i``; padding queries are 0.
        Softmax and accumulation are in float32.

    On CUDA tensors this runs the compiled CUDA kernel, or the Triton kernel
    (``poss_ext/triton_attention.py``) when ``POSS_ATTENTION=triton`` is set (see below).
    """
    return torch.ops.poss.tree_attention(q, k_cache, v_cache, prefix_len, parents, scale)


@torch.library.register_fake("poss::tree_attention")
def _tree_attention_fake(q, k_cache, v_cache, prefix_len, parents, scale):
    torch._check(q.dim() == 4, lambda: "q must be [B, Hq, Nq, D]")
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# ---- KV cache ---------------------------------------------------------------------------------


def kv_compact(
    k_cache: Tensor, v_cache: Tensor, prefix_len: Tensor, accept_nodes: Tensor, accept_len: Tensor
) -> None:
    """Move the accepted path's K/V to contiguous slots behind the prefix, for every layer, in place.

    Args:
        k_cache: ``[L, B, Hkv, S, D]`` float32 / bfloat16 / float16, contiguous in ``D``;
            modified in place.
        v_cache: like ``k_cache`` (same shape and dtype, separate memory); modified in place.
        prefix_len: ``[B] int32``, the slot of tree node 0.
        accept_nodes: ``[B, N] int32``, from ``tree_verify``: the accepted path's node ids, root
            first, strictly increasing; entries after ``accept_len[b]`` are ignored.
        accept_len: ``[B] int32`` in ``[0, N)``, accepted draft tokens (root not counted).

    For every layer, head and ``j = 0..accept_len[b]``, slot ``prefix_len[b] + accept_nodes[b, j]``
    is copied to slot ``prefix_len[b] + j``. Overlapping moves are handled (the result equals a
    gather from a copy of the cache). Slots past the new end keep stale values.

    Invalid move lists raise a RuntimeError on the CPU before anything moves; on CUDA they trip a
    device-side assert (no host sync).
    """
    torch.ops.poss.kv_compact(k_cache, v_cache, prefix_len, accept_nodes, accept_len)


@torch.library.register_fake("poss::kv_compact")
def _kv_compact_fake(k_cache, v_cache, prefix_len, accept_nodes, accept_len):
    torch._check(k_cache.dim() == 5, lambda: "k_cache must be [L, B, Hkv, S, D]")
    return None


# ---- Decoder layer ----------------------------------------------------------------------------


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, residual: Optional[Tensor] = None) -> Tensor:
    """``x @ weight.T + bias + residual``, accumulated in fp32 and rounded once.

    Args:
        x: ``[..., K]`` float32 / bfloat16 / float16.
        weight: ``[N, K]``, x's dtype and device.
        bias: ``[N]`` or None; residual: ``[..., N]`` (x's leading shape) or None.
    Returns:
        ``[..., N]`` in x's dtype. Where :func:`cpu_linear_kernel` names one of our kernels (bf16 on
        AVX512-BF16, bf16 and fp32 on AVX2 + FMA), rows are computed independently of each other:
        row i of a call is bit-identical to the same row computed alone. No backward (inference
        only).
    """
    return torch.ops.poss.linear(x, weight, bias, residual)


@torch.library.register_fake("poss::linear")
def _linear_fake(x, weight, bias=None, residual=None):
    torch._check(weight.dim() == 2 and weight.shape[1] == x.shape[-1], lambda: "weight must be [N, K]")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def cpu_linear_kernel(dtype: torch.dtype = torch.bfloat16) -> str:
    """The CPU kernel of :func:`linear` for ``dtype``: ``"avx512-bf16"`` (bf16 on a CPU with
    AVX512-BF16), ``"avx2-bf16"`` (bf16 on a CPU with AVX2 + FMA but not AVX512-BF16: the weights
    widened to fp32 as they stream) or ``"avx2-fma"`` (fp32 on AVX2 + FMA), our row-invariant
    kernels; else ``"aten"``
    (the vendor GEMM; also forced by ``POSS_LINEAR=aten`` when poss_ext was loaded). ``POSS_LINEAR=avx2``
    runs the AVX2 kernels on an AVX512-BF16 CPU too (to test and time them there)."""
    from poss_ext import _C

    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    return _C.cpu_linear_kernel(str(dtype).replace("torch.", ""))


# ---- Linear with GGUF block weights ----------------------------------------------------------

# Bytes of one block of 32 weights in each format poss::qlinear reads (csrc/include/poss/qlinear_args.h);
# "x8": the same blocks with rows interleaved by 8 (:func:`interleave_rows8`).
QFORMAT_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q8_0x8": 34, "q4_0x8": 18, "q4_1x8": 20}
QBLOCK = 32


def _rows8_args(blocks: Tensor, format: str) -> Tuple[int, int, int]:
    """Check the arguments of :func:`interleave_rows8` / :func:`deinterleave_rows8`; return N, the block
    bytes B and the fp16 fields a block starts with (d, and q4_1's m)."""
    if format not in ("q8_0", "q4_0", "q4_1"):
        raise ValueError(f"format must be 'q8_0', 'q4_0' or 'q4_1' (the file's format), got {format!r}")
    B = QFORMAT_BLOCK_BYTES[format]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % B:
        raise ValueError(f"blocks must be [N, K / 32 * {B}] uint8, got {blocks.dtype} {tuple(blocks.shape)}")
    N = blocks.shape[0]
    if N % 8:
        raise ValueError(f"blocks.shape[0] (N) must be a multiple of 8 for rows interleaved by 8, got {N}")
    return N, B, 2 if format == "q4_1" else 1


def interleave_rows8(blocks: Tensor, format: str) -> Tensor:
    """``blocks [N, K / 32 * B] uint8`` in ``format`` ("q8_0", "q4_0" or "q4_1", N a multiple of 8) ->
    the same bytes with rows interleaved by 8, format ``format + "x8"`` (csrc/include/poss/qlinear_args.h):
    per group of 8 rows and block, the 8 rows' d (q4_1: then their m), then their quants as 4-byte
    words, word j of row k at ``32 j + 4 k``. The int8 kernels then load 8 rows' scales and each word as one
    vector (no transpose) and read one stream. Returns a new contiguous tensor of the same shape."""
    N, B, scales = _rows8_args(blocks, format)
    b = blocks.reshape(N // 8, 8, -1, B).transpose(1, 2)  # [group, block, row of 8, B]
    fields = [b[..., 2 * s:2 * s + 2].flatten(-2) for s in range(scales)]  # [group, block, 16] each
    words = b[..., 2 * scales:].unflatten(-1, (-1, 4)).transpose(-3, -2).flatten(-3)  # [group, block, 8 * quants]
    return torch.cat(fields + [words], dim=-1).reshape(N, -1).contiguous()


def deinterleave_rows8(blocks: Tensor, format: str) -> Tensor:
    """:func:`interleave_rows8` undone: ``blocks`` with rows interleaved by 8 in ``format`` ("q8_0",
    "q4_0" or "q4_1", the file's format) -> the file's layout, a new contiguous tensor."""
    N, B, scales = _rows8_args(blocks, format)
    rec = blocks.reshape(N // 8, -1, 8 * B)  # [group, block, record]
    fields = [rec[..., 16 * s:16 * s + 16].unflatten(-1, (8, 2)) for s in range(scales)]  # [g, b, row, 2]
    words = rec[..., 16 * scales:].unflatten(-1, (-1, 8, 4)).transpose(-3, -2).flatten(-2)  # [g, b, row, quants]
    return torch.cat(fields + [words], dim=-1).transpose(1, 2).reshape(N, -1).contiguous()


def qlinear(x: Tensor, blocks: Tensor, format: str, bias: Optional[Tensor] = None,
            residual: Optional[Tensor] = None, x_int8: bool = False) -> Tensor:
    """``x @ W.T + bias + residual`` with ``W [N, K]`` in a GGUF block format, accumulated in fp32.

    Args:
        x: ``[..., K]`` float32 / bfloat16 / float16 on the CPU; ``K`` a multiple of 32.
        blocks: ``[N, K / 32 * B] uint8``, each row ``K / 32`` blocks of 32 weights exactly as a GGUF
            file stores them (``B`` = :data:`QFORMAT_BLOCK_BYTES` of the format):
            ``"q8_0"``: fp16 d, 32 int8 q, ``w = q * d``; ``"q4_0"``: fp16 d, 16 bytes of nibbles,
            ``w = (q - 8) * d``; ``"q4_1"``: fp16 d, fp16 m, 16 bytes of nibbles, ``w = q * d + m``.
            Byte j of the nibbles holds weight j (low nibble) and weight j + 16 (high nibble).
        format: ``"q8_0"``, ``"q4_0"`` or ``"q4_1"``; with ``"x8"`` (``"q4_1x8"``...): those blocks
            with rows interleaved by 8 (:func:`interleave_rows8`, N a multiple of 8), the same result.
        bias: ``[N]`` or None; residual: ``[..., N]`` or None; x's dtype.
        x_int8: False: x as fp32. True: x quantized per row and block of 32 to int8 with one fp32
            scale ``dx = amax / 127`` per block (``q = round-half-even(x / dx)``), each block's dot
            product with the weights an exact int32 sum (:func:`poss_ext.reference.qlinear_int8`).
    Returns:
        ``[..., N]`` in x's dtype. Each element (x_int8 False): the block's weights decoded to fp32
        exactly as gguf decodes them, 32 fp32 lanes of FMAs over K, a fixed pairwise sum of the lanes,
        + bias, + residual, one rounding. (x_int8 True): each block's ``(dw * dx) * isum`` (q4_1
        ``+ (m * dx) * sum(q)``) added into 8 fp32 lanes, a fixed pairwise sum, + bias, + residual,
        one rounding. Every row is computed that way however many rows share the call, and every
        kernel (:func:`cpu_qlinear_kernel`) gives the same bits. A block whose scale (or min) is inf
        or NaN is an error. No CUDA kernel and no backward.
    """
    return torch.ops.poss.qlinear(x, blocks, format, bias, residual, x_int8)


@torch.library.register_fake("poss::qlinear")
def _qlinear_fake(x, blocks, format, bias=None, residual=None, x_int8=False):
    torch._check(format in QFORMAT_BLOCK_BYTES, lambda: f"format must be one of {list(QFORMAT_BLOCK_BYTES)}")
    torch._check(blocks.dim() == 2 and blocks.shape[1] * QBLOCK == x.shape[-1] * QFORMAT_BLOCK_BYTES[format],
                 lambda: "blocks must be [N, K / 32 * block bytes]")
    torch._check(not format.endswith("x8") or blocks.shape[0] % 8 == 0,
                 lambda: "blocks.size(0) (N) must be a multiple of 8 in a format with rows interleaved by 8")
    return x.new_empty((*x.shape[:-1], blocks.shape[0]))


def _qlinear_cuda(x, blocks, format, bias=None, residual=None, x_int8=False):
    raise RuntimeError("poss::qlinear has CPU kernels only; on CUDA, load the target with a float dtype "
                       "(bf16 / fp16 / fp32) instead of 'gguf'")


def _register_qlinear_cuda_error() -> None:
    """qlinear has no CUDA kernel in any build: CUDA tensors get an error that says what to do instead of
    the dispatcher's "could not run with arguments from the CUDA backend"."""
    torch.library.register_kernel("poss::qlinear", "CUDA", _qlinear_cuda)


def cpu_qlinear_kernel(x_int8: bool = False) -> str:
    """The kernel :func:`qlinear` runs on this CPU: ``"avx512"`` (AVX512F + BW + VL), ``"avx2"``
    (AVX2 + FMA + F16C) or ``"scalar"``; all give the same bits. ``POSS_QLINEAR`` (read once, when
    poss_ext loads) picks one, as :func:`force_cpu_qlinear_kernel` does later. ``x_int8``: the kernel
    of the int8-activation path, ``"amx"`` (AMX-INT8 tile multiplies for 12+ rows of x on interleaved
    weights, the VNNI kernel otherwise), ``"avx512vnni"`` (AVX512-VNNI + VL), ``"avx2"`` or ``"scalar"``
    (an AVX512 CPU without VNNI runs the AVX2 one)."""
    from poss_ext import _C

    return _C.cpu_qlinear_kernel(x_int8)


def force_cpu_qlinear_kernel(name: str = "") -> None:
    """Run :func:`qlinear` with kernel ``name`` (``"amx"``, ``"avx512vnni"``, ``"avx512"``, ``"avx2"``,
    ``"scalar"``) from now on; ``""`` goes back to the best this CPU has. ``"amx"`` and
    ``"avx512vnni"`` run the AVX512 kernel for fp32 activations; ``"avx512"`` the AVX2 one for int8. A
    kernel this CPU cannot run is a RuntimeError."""
    from poss_ext import _C

    _C.force_cpu_qlinear_kernel(name)


def force_vocab_chunk_len(length: int = 0) -> int:
    """Split :func:`tree_verify`'s vocabulary into chunks of ``length`` tokens from now on, on every
    device (at most 64 chunks: longer ones when V needs it); ``0`` goes back to the split by shape
    (``csrc/include/poss/vocab_split.h``). Tests use it to split small vocabularies. Returns the
    previous setting."""
    from poss_ext import _C

    previous = _C.vocab_chunk_len()
    _C.force_vocab_chunk_len(length)
    return previous


def cpu_exact_attention_lanes() -> int:
    """SIMD lanes of the row-exact CPU path of :func:`tree_attention` (requests behind a committed
    prefix): 16 on CPUs with AVX512F, else 8. Both widths give the same bits; ``POSS_ATTENTION_LANES=8``
    (read once) forces 8, to test and time the AVX2 loops on an AVX512F CPU."""
    from poss_ext import _C

    return _C.cpu_exact_attention_lanes()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim: ``x [..., H]`` float32/bf16/fp16, ``weight [H]`` same dtype -> ``[..., H]``."""
    return torch.ops.poss.rms_norm(x, weight, eps)


@torch.library.register_fake("poss::rms_norm")
def _rms_norm_fake(x, weight, eps):
    torch._check(weight.shape == (x.shape[-1],), lambda: "weight must be [H]")
    return torch.empty_like(x, memory_format=torch.contiguous_format)  # the kernel writes x.contiguous()'s layout


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    """``sum = x + residual`` (rounded to x's dtype), ``out = rms_norm(sum)``; returns ``(out, sum)``,
    both ``[..., H]``.
    """
    return torch.ops.poss.add_rms_norm(x, residual, weight, eps)


@torch.library.register_fake("poss::add_rms_norm")
def _add_rms_norm_fake(x, residual, weight, eps):
    torch._check(residual.shape == x.shape, lambda: "residual must have x's shape")
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


def swiglu(gate_up: Tensor) -> Tensor:
    """``gate_up [..., 2F]`` (gate, then up) -> ``silu(gate) * up`` ``[..., F]``."""
    return torch.ops.poss.swiglu(gate_up)


@torch.library.register_fake("poss::swiglu")
def _swiglu_fake(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def rope_qkv(qkv: Tensor, positions: Tensor, inv_freq: Tensor, k_cache: Tensor, v_cache: Tensor,
             start: Tensor, num_heads: int, num_kv_heads: int) -> Tensor:
    """Split a fused QKV projection, apply RoPE, write K/V into the cache, return rotated q.

    Args:
        qkv: ``[B, T, (Hq + 2 Hkv) D]``; per token q heads, then k heads, then v heads.
        positions: ``[B, T] int64`` RoPE positions.
        inv_freq: ``[D / 2] float32`` inverse frequencies (any RoPE scaling is folded in here).
        k_cache, v_cache: ``[B, Hkv, S, D]``, qkv's dtype, contiguous, separate memory; token t goes to
            slot ``start[b] + t`` (in place).
        start: ``[B] int32``.
    Returns:
        q: ``[B, Hq, T, D]``. Rotate-half layout (HF Llama): element i pairs with i + D/2.
    """
    return torch.ops.poss.rope_qkv(qkv, positions, inv_freq, k_cache, v_cache, start, num_heads, num_kv_heads)


@torch.library.register_fake("poss::rope_qkv")
def _rope_qkv_fake(qkv, positions, inv_freq, k_cache, v_cache, start, num_heads, num_kv_heads):
    B, T, _ = qkv.shape
    return qkv.new_empty((B, num_heads, T, k_cache.shape[-1]))


def decoder_layer(x, in_norm_w, w_qkv, b_qkv, w_o, post_norm_w, w_gate_up, w_down, k_cache, v_cache,
                  prefix_len, parents, positions, inv_freq, num_heads: int, num_kv_heads: int,
                  eps: float) -> Tensor:
    """One fused Llama/Qwen2/Mistral decoder layer over the tree's last T nodes.

    Args:
        x: ``[B, T, H]`` residual stream in; float32/bf16/fp16.
        in_norm_w: ``[H]`` input RMSNorm weight, or None (PosS specialists have none).
        w_qkv: ``[(Hq + 2 Hkv) D, H]`` q, k, v projections stacked; b_qkv: ``[(Hq + 2 Hkv) D]`` or None.
        w_o: ``[H, Hq D]``; post_norm_w: ``[H]``; w_gate_up: ``[2F, H]`` (gate rows, then up rows);
        w_down: ``[H, F]``.
        k_cache, v_cache: ``[B, Hkv, S, D]``; the new tokens' K/V are written at slots
            ``prefix_len + N - T + t`` (in place).
        prefix_len: ``[B] int32`` committed cache length; parents: ``[B, N] int32`` tree (N >= T);
        positions: ``[B, T] int64``; inv_freq: ``[D / 2] float32``.
    Returns:
        ``[B, T, H]`` residual stream out.
    """
    return torch.ops.poss.decoder_layer(x, in_norm_w, w_qkv, b_qkv, w_o, post_norm_w, w_gate_up, w_down,
                                        k_cache, v_cache, prefix_len, parents, positions, inv_freq,
                                        num_heads, num_kv_heads, eps)


@torch.library.register_fake("poss::decoder_layer")
def _decoder_layer_fake(x, *args):
    return torch.empty_like(x, memory_format=torch.contiguous_format)  # a view of the last GEMM's output


def qdecoder_layer(x, in_norm_w, w_qkv, b_qkv, w_o, post_norm_w, w_gate_up, w_down, formats: List[str],
                   x_int8: bool, k_cache, v_cache, prefix_len, parents, positions, inv_freq, num_heads: int,
                   num_kv_heads: int, eps: float) -> Tensor:
    """:func:`decoder_layer` with any of its projections in GGUF blocks (CPU).

    Args:
        formats: 4 entries, for w_qkv, w_o, w_gate_up, w_down: ``""`` where the weight is a float tensor
            (shapes as :func:`decoder_layer`; :func:`linear`), else its :func:`qlinear` format, the weight
            then ``[N, K / 32 * B] uint8`` blocks of that ``[N, K]`` (run with ``x_int8``).
        The rest as :func:`decoder_layer`; the same ops in the same order, one dispatch for the layer.
    Returns:
        ``[B, T, H]`` residual stream out.
    """
    return torch.ops.poss.qdecoder_layer(x, in_norm_w, w_qkv, b_qkv, w_o, post_norm_w, w_gate_up, w_down,
                                         formats, x_int8, k_cache, v_cache, prefix_len, parents, positions,
                                         inv_freq, num_heads, num_kv_heads, eps)


@torch.library.register_fake("poss::qdecoder_layer")
def _qdecoder_layer_fake(x, *args):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def specialist_forward(embeds, features, fc_w, fc_b, w_qkv, w_o, post_norm_w, w_gate_up, w_down,
                       k_cache, v_cache, prefix_len, parents, positions, inv_freq, num_heads: int,
                       num_kv_heads: int, eps: float) -> Tensor:
    """One PosS specialist over T new tokens, fused: ``u = fc([embeds; features])``, then
    :func:`decoder_layer` without input norm on that specialist's cache.

    Args:
        embeds, features: ``[B, T, H]``: the target embedding of x_{t+1} and the feature f_t.
        fc_w: ``[H, 2H]``; fc_b: ``[H]`` or None. Other arguments as in :func:`decoder_layer`.
    Returns:
        ``[B, T, H]``: the specialist's output features (lm_head input, no norm).
    """
    return torch.ops.poss.specialist_forward(embeds, features, fc_w, fc_b, w_qkv, w_o, post_norm_w,
                                             w_gate_up, w_down, k_cache, v_cache, prefix_len, parents,
                                             positions, inv_freq, num_heads, num_kv_heads, eps)


@torch.library.register_fake("poss::specialist_forward")
def _specialist_forward_fake(embeds, *args):
    return torch.empty_like(embeds, memory_format=torch.contiguous_format)


def eagle3_layer_forward(embeds, hidden, input_norm_w, hidden_norm_w, w_qkv, w_o, post_norm_w, w_gate_up,
                         w_down, k_cache, v_cache, prefix_len, parents, positions, inv_freq, num_heads: int,
                         num_kv_heads: int, eps: float) -> Tensor:
    """One EAGLE-3 draft layer over T new tokens, fused.

    q/k/v project ``[rms_norm(embeds, input_norm_w); rms_norm(hidden, hidden_norm_w)]`` (2H features,
    the embedding first); then RoPE, the K/V write, tree attention and ``o_proj`` plus ``hidden`` (the
    residual is the un-normalised hidden), the post-attention RMSNorm and the SwiGLU MLP plus residual,
    as :func:`decoder_layer`.

    Args:
        embeds: ``[B, T, H]`` the target embedding of x_{t+1}; float32/bf16/fp16.
        hidden: ``[B, T, H]`` same dtype: the fused target feature ``fc(three layers)`` or the draft's
            own output at the parent position.
        input_norm_w, hidden_norm_w: ``[H]``.
        w_qkv: ``[(Hq + 2 Hkv) D, 2H]``. Other arguments as in :func:`decoder_layer`.
    Returns:
        ``[B, T, H]``: the layer's output (the input of the draft's final norm, and of its next step).
    """
    return torch.ops.poss.eagle3_layer_forward(embeds, hidden, input_norm_w, hidden_norm_w, w_qkv, w_o,
                                               post_norm_w, w_gate_up, w_down, k_cache, v_cache, prefix_len,
                                               parents, positions, inv_freq, num_heads, num_kv_heads, eps)


@torch.library.register_fake("poss::eagle3_layer_forward")
def _eagle3_layer_forward_fake(embeds, hidden, *args):
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


# ---- Devices without compiled kernels ---------------------------------------------------------


def _register_fallbacks(build_info: dict) -> None:
    """Serve the ops on CUDA tensors with the pure-PyTorch references when no CUDA kernel was built,
    behind the kernels' argument checks (poss_ext/fallback.py)."""
    if build_info["cuda"]:
        return
    # decoder_layer, specialist_forward and eagle3_layer_forward are composites: they dispatch to these.
    for name in ("tree_verify", "build_tree", "tree_attention", "kv_compact", "linear", "rms_norm",
                 "add_rms_norm", "swiglu", "rope_qkv"):
        if name == "tree_attention" and ATTENTION_BACKEND == "triton":
            continue  # _register_attention_backend serves it
        torch.library.register_kernel(f"poss::{name}", "CUDA", fallback.checked(name))


# ---- Attention kernel on CUDA -----------------------------------------------------------------

# POSS_ATTENTION, read once when poss_ext is imported, picks the kernel of poss::tree_attention for
# CUDA tensors: "cuda" (default) the compiled CUDA kernel, "triton" the Triton kernel of
# poss_ext/triton_attention.py. The choice is made at the dispatcher, so every caller takes it: this
# module's wrapper, torch.ops.poss.tree_attention, and the fused decoder_layer / specialist_forward.
ATTENTION_BACKENDS = ("cuda", "triton")
ATTENTION_BACKEND = os.environ.get("POSS_ATTENTION", "").strip().lower() or "cuda"


def _register_attention_backend() -> None:
    if ATTENTION_BACKEND not in ATTENTION_BACKENDS:
        raise ValueError(f"POSS_ATTENTION must be one of {', '.join(ATTENTION_BACKENDS)}, "
                         f"got {os.environ.get('POSS_ATTENTION')!r}")
    if ATTENTION_BACKEND == "triton":
        from poss_ext.triton_attention import tree_attention_triton  # needs triton; only on request

        torch.library.register_kernel("poss::tree_attention", "CUDA", tree_attention_triton)
