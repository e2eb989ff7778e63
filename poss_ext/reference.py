"""Pure-PyTorch references of the poss ops.

They are written to be read: one request and one tree node at a time. The tests compare the
kernels against them, and ``poss_ext`` serves an op with its reference on a device for which no
kernel was compiled.
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

PAD = -2


def real_nodes(parents_row: List[int]) -> int:
    """Number of real (non-padding) nodes of one request's tree."""
    n = 1
    while n < len(parents_row) and parents_row[n] != PAD:
        n += 1
    return n


def children_lists(parents_row: List[int]) -> List[List[int]]:
    """children[i] = the children of node i, in node order."""
    n = real_nodes(parents_row)
    children: List[List[int]] = [[] for _ in range(len(parents_row))]
    for i in range(1, n):
        children[parents_row[i]].append(i)
    return children


# ---- Tree verification and sampling -----------------------------------------------------------


def processed_weights(row: Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> Tensor:
    """The target's sampling distribution at one node, unnormalised, as float64 ``[V]``.

    softmax(row / temperature), then top-k (every token tied with the k-th largest logit stays),
    then top-p over the renormalised result (the smallest set of most likely tokens whose mass
    reaches top_p; every token tied with the last one stays), then min-p over what survived (the
    tokens whose weight is >= min_p times the largest weight, that product rounded to float32).
    """
    x = row.float()
    if torch.isnan(x).any():
        raise RuntimeError("tree_verify: logits row contains NaN")
    m = x.max()
    if not torch.isfinite(m):
        raise RuntimeError("tree_verify: logits row has no finite maximum")
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < x.numel():
        keep = x >= torch.topk(x, top_k).values[-1]
    w = torch.where(keep, torch.exp((x - m) * (1.0 / temperature)), torch.zeros_like(x))
    w = w.double()
    if top_p < 1.0:
        desc = torch.sort(w, descending=True).values
        crossing = int(torch.searchsorted(torch.cumsum(desc, 0), top_p * w.sum()))
        w = torch.where(w >= desc[min(crossing, len(desc) - 1)], w, torch.zeros_like(w))
    if min_p > 0.0:
        floor = torch.tensor(min_p, dtype=torch.float32) * w.max().float()  # a float32 product
        w = torch.where(w >= floor.double(), w, torch.zeros_like(w))
    return w


def sample_index(w: Tensor, u: float) -> int:
    """Inverse-CDF draw from unnormalised weights ``w`` with one uniform ``u`` in [0, 1)."""
    cdf = torch.cumsum(w, 0)
    idx = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    positive = torch.nonzero(w > 0).flatten()
    return min(idx, int(positive[-1]))


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
    """Reference of ``torch.ops.poss.tree_verify``; see ``poss_ext.ops.tree_verify`` for the contract."""
    B, N = parents.shape
    device = parents.device
    accept_nodes = torch.full((B, N), -1, dtype=torch.int32)
    accept_len = torch.zeros(B, dtype=torch.int32)
    next_token = torch.zeros(B, dtype=torch.int64)
    par, tok = parents.tolist(), tokens.tolist()
    for b in range(B):
        children = children_lists(par[b])
        temp = 0.0 if temperature is None else float(temperature[b])
        path = [0]
        if temp <= 0.0:  # greedy
            while True:
                row = logits[b, path[-1]].float()
                if torch.isnan(row).any():
                    raise RuntimeError("tree_verify: logits row contains NaN")
                best = int(torch.argmax(row))
                match = [c for c in children[path[-1]] if tok[b][c] == best]
                if not match:
                    break
                path.append(match[0])
            nxt = best
        else:
            if uniforms is None:
                raise RuntimeError("uniforms is required when any temperature > 0")
            k = 0 if top_k is None else int(top_k[b])
            p = 1.0 if top_p is None else float(top_p[b])
            mp = 0.0 if min_p is None else float(min_p[b])
            u = uniforms[b].tolist()
            while True:
                w = processed_weights(logits[b, path[-1]], temp, k, p, mp)
                accepted = None
                for c in children[path[-1]]:
                    x = tok[b][c]
                    if w[x] > 0 and u[c] * float(w.sum()) < w[x]:
                        accepted = c
                        break
                    w[x] = 0.0
                if accepted is None:
                    break
                path.append(accepted)
            nxt = sample_index(w, u[N])
        accept_nodes[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        accept_len[b] = len(path) - 1
        next_token[b] = nxt
    return accept_nodes.to(device), accept_len.to(device), next_token.to(device)


# ---- Tree building ----------------------------------------------------------------------------


def build_tree(
    cand_tokens: Tensor,
    cand_scores: Tensor,
    cand_parents: Tensor,
    root_token: Tensor,
    num_nodes: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Reference of ``torch.ops.poss.build_tree``; see ``poss_ext.ops.build_tree`` for the contract."""
    if num_nodes < 1:
        raise RuntimeError(f"num_nodes must be >= 1 (the root counts), got {num_nodes}")
    B, M = cand_tokens.shape
    device = cand_tokens.device
    tokens = torch.zeros((B, num_nodes), dtype=torch.int64)
    parents = torch.full((B, num_nodes), PAD, dtype=torch.int32)
    depth = torch.zeros((B, num_nodes), dtype=torch.int32)
    tok, sc, par = cand_tokens.tolist(), cand_scores.float().tolist(), cand_parents.tolist()
    roots = root_token.tolist()
    for b in range(B):
        # Path minimum and depth of every candidate; parents come before their children.
        path_min, cand_depth, real = {}, {}, []
        for i in range(M):
            p = par[b][i]
            if p == PAD:
                continue
            if not -1 <= p < i:
                raise RuntimeError(f"cand_parents[{b}, {i}] = {p} must be in [-1, {i}) or -2")
            if p >= 0 and par[b][p] == PAD:
                raise RuntimeError(f"cand_parents[{b}, {i}] = {p} points to an empty candidate slot")
            if sc[b][i] != sc[b][i]:
                raise RuntimeError(f"cand_scores[{b}, {i}] is NaN")
            path_min[i] = sc[b][i] if p < 0 else min(sc[b][i], path_min[p])
            cand_depth[i] = 1 if p < 0 else cand_depth[p] + 1
            real.append(i)
        # Highest path minimum first, lower index first among equals; keep in index order.
        ranked = sorted(real, key=lambda i: (-path_min[i], i))
        kept = sorted(ranked[: num_nodes - 1])
        node_of = {c: n + 1 for n, c in enumerate(kept)}
        tokens[b, 0], parents[b, 0] = roots[b], -1
        for n, c in enumerate(kept, start=1):
            tokens[b, n] = tok[b][c]
            parents[b, n] = 0 if par[b][c] < 0 else node_of[par[b][c]]
            depth[b, n] = cand_depth[c]
    return tokens.to(device), parents.to(device), depth.to(device)


# ---- Tree attention ---------------------------------------------------------------------------


def tree_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    prefix_len: Tensor,
    parents: Tensor,
    scale: float,
) -> Tensor:
    """Reference of ``torch.ops.poss.tree_attention``; see ``poss_ext.ops.tree_attention``.

    One request and one query head at a time: build the visibility mask over the cache slots
    (the prefix, then the query node's ancestors and itself), softmax in float32, then V.
    """
    B, Hq, Nq, D = q.shape
    Hkv, N = k_cache.shape[1], parents.shape[1]
    group = Hq // Hkv
    out = torch.zeros_like(q)
    par = parents.tolist()
    for b in range(B):
        prefix = int(prefix_len[b])
        n = real_nodes(par[b])
        # visible[i, j]: tree node j is node i or one of its ancestors.
        visible = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            visible[i, i] = True
            if i > 0:
                visible[i] |= visible[par[b][i]]
        for qi in range(Nq):
            node = N - Nq + qi
            if node >= n:
                continue  # padding query: output stays zero
            keys = list(range(prefix)) + [prefix + j for j in range(n) if visible[node, j]]
            idx = torch.tensor(keys, dtype=torch.long, device=q.device)
            for hq in range(Hq):
                h = hq // group
                k = k_cache[b, h].index_select(0, idx).float()
                v = v_cache[b, h].index_select(0, idx).float()
                p = torch.softmax((k @ q[b, hq, qi].float()) * scale, dim=0)
                out[b, hq, qi] = (p @ v).to(q.dtype)
    return out


# ---- KV cache ---------------------------------------------------------------------------------


def kv_compact(
    k_cache: Tensor, v_cache: Tensor, prefix_len: Tensor, accept_nodes: Tensor, accept_len: Tensor
) -> None:
    """Reference of ``torch.ops.poss.kv_compact`` (in place); see ``poss_ext.ops.kv_compact``."""
    B, N = accept_nodes.shape
    S = k_cache.shape[3]
    pre, nodes, lens = prefix_len.tolist(), accept_nodes.tolist(), accept_len.tolist()
    for b in range(B):
        if not 0 <= lens[b] < N:
            raise RuntimeError(f"accept_len[{b}] = {lens[b]} must be in [0, {N})")
        if pre[b] < 0:
            raise RuntimeError(f"prefix_len[{b}] = {pre[b]} must be >= 0")
        path = nodes[b][: lens[b] + 1]
        for j, a in enumerate(path):
            if a < 0 or a >= N or (j > 0 and a <= path[j - 1]):
                raise RuntimeError(f"accept_nodes[{b}, {j}] = {a} must be in [0, {N}) and increasing")
            if pre[b] + a >= S:
                raise RuntimeError(f"prefix_len[{b}] + accept_nodes[{b}, {j}] must be < S = {S}")
        # Gather from a copy, then write: no reasoning about overlapping moves needed here.
        src = torch.tensor([pre[b] + a for a in path], dtype=torch.long, device=k_cache.device)
        dst = slice(pre[b], pre[b] + len(path))
        for cache in (k_cache, v_cache):
            cache[:, b, :, dst] = cache[:, b, :, :].index_select(2, src).clone()


# ---- Decoder layer ----------------------------------------------------------------------------


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, residual: Optional[Tensor] = None) -> Tensor:
    """``x [..., K] @ weight [N, K]^T + bias [N] + residual [..., N]`` in fp64, rounded once to x's dtype."""
    y = x.double() @ weight.double().t()
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.double()
    return y.to(x.dtype)


QFORMAT_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q8_0x8": 34, "q4_0x8": 18, "q4_1x8": 20}


def plain_rows(blocks: Tensor, format: str) -> Tuple[Tensor, str]:
    """Blocks in ``format`` -> the same weight in the file's layout and its format: a format with rows
    interleaved by 8 (``"q8_0x8"``, ``"q4_1x8"``...; csrc/include/poss/qlinear_args.h) unpacked field by
    field, any other as it is."""
    if not format.endswith("x8"):
        return blocks, format
    base = format[:-2]
    B = QFORMAT_BLOCK_BYTES[base]
    scales = 2 if base == "q4_1" else 1
    N = blocks.shape[0]
    nb = blocks.shape[1] // B
    out = torch.empty_like(blocks).reshape(N, nb, B)
    rec = blocks.reshape(N // 8, nb, 8 * B)  # group, block, the group's record of that block
    for k in range(8):
        rows = out[k::8]  # row 8g + k of every group g
        for s in range(scales):  # d, then q4_1's m: the 8 rows' fp16 one after another
            rows[..., 2 * s:2 * s + 2] = rec[..., 16 * s + 2 * k:16 * s + 2 * k + 2]
        for j in range((B - 2 * scales) // 4):  # quant word j of row k
            at = 16 * scales + 32 * j + 4 * k
            rows[..., 2 * scales + 4 * j:2 * scales + 4 * j + 4] = rec[..., at:at + 4]
    return out.reshape(N, nb * B), base


def dequantize(blocks: Tensor, format: str) -> Tensor:
    """GGUF blocks ``[N, K / 32 * B] uint8`` -> the weights ``[N, K] float32``.

    A block is ``fp16 d`` (q8_0, q4_0) or ``fp16 d, fp16 m`` (q4_1), then its quants: 32 int8
    (``w = q * d``) or 16 bytes whose low nibbles are weights 0..15 and high nibbles 16..31
    (q4_0: ``w = (q - 8) * d``; q4_1: ``w = q * d + m``, one fp32 rounding). Rows interleaved by 8:
    see :func:`plain_rows`.
    """
    blocks, format = plain_rows(blocks, format)
    N = blocks.shape[0]
    b = blocks.reshape(N, -1, QFORMAT_BLOCK_BYTES[format])
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [N, nb, 1]
    if format == "q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(N, -1)
    qs = b[..., 4:] if format == "q4_1" else b[..., 2:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()  # [N, nb, 32]: low nibbles first
    if format == "q4_0":
        return ((q - 8) * d).reshape(N, -1)
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    return (q * d + m).reshape(N, -1)  # q * d is exact in fp32: one rounding, as the kernels' FMA


def qlinear(x: Tensor, blocks: Tensor, format: str, bias: Optional[Tensor] = None,
            residual: Optional[Tensor] = None) -> Tensor:
    """:func:`linear` with the weight in GGUF blocks: the dequantised fp32 weights, the products and
    sums in fp64, rounded once to x's dtype."""
    return linear(x, dequantize(blocks, format).to(x.device), bias, residual)


QX_LANES = 8  # fp32 lanes of qlinear's int8 path: block b adds into lane b % 8


def quantize_x_int8(x: Tensor) -> Tuple[Tensor, Tensor]:
    """x ``[..., K]`` (K a multiple of 32) -> ``q [..., K / 32, 32] int64`` in [-127, 127] and
    ``dx [..., K / 32] float32``, per block of 32: ``dx = amax / 127``, ``q = round-half-even(x / dx)``
    (fp32 division) clamped to [-127, 127]; a block whose dx is 0 or not finite has every q = 0."""
    xf = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = xf.abs().amax(-1)  # NaN if the block has one
    dx = amax / torch.full_like(amax, 127.0)
    ok = torch.isfinite(dx) & (dx > 0)
    div = torch.where(ok, dx, torch.ones_like(dx)).unsqueeze(-1).expand_as(xf).contiguous()
    q = torch.round(xf / div).clamp(-127, 127)
    q = torch.where(ok.unsqueeze(-1), q, torch.zeros_like(q))
    return q.long(), dx


def qlinear_int8(x: Tensor, blocks: Tensor, format: str, bias: Optional[Tensor] = None,
                 residual: Optional[Tensor] = None) -> Tensor:
    """``qlinear(..., x_int8=True)``: x quantized by :func:`quantize_x_int8`, each (row, weight row,
    block) an exact integer ``isum = sum q_w * q_x`` (int64; q_w the int8 of q8_0, q - 8 of q4_0, q of
    q4_1), the block's value in fp32 ``(dw * dx) * isum`` (q4_1: ``+ (m * dx) * sum(q_x)``), each
    operation rounded; lane ``b % 8`` adds block b's value in block order; lanes summed l + 4, l + 2,
    l + 1; + bias, + residual in fp32; one rounding to x's dtype. Shapes as :func:`qlinear`."""
    blocks, format = plain_rows(blocks, format)
    N, K = blocks.shape[0], x.shape[-1]
    nb = K // 32
    lead = x.shape[:-1]
    qx, dx = quantize_x_int8(x.reshape(-1, K))  # [M, nb, 32], [M, nb]
    b = blocks.reshape(N, nb, QFORMAT_BLOCK_BYTES[format])
    dw = b[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)  # [N, nb]
    if format == "q8_0":
        qw = b[..., 2:].contiguous().view(torch.int8).long()
    else:
        nib = b[..., 4:] if format == "q4_1" else b[..., 2:]
        qw = torch.cat([nib & 15, nib >> 4], dim=-1).long()  # low nibbles are weights 0..15
        if format == "q4_0":
            qw = qw - 8
    isum = torch.einsum("mbl,nbl->mnb", qx, qw)  # [M, N, nb] int64, exact
    v = (dw.unsqueeze(0) * dx.unsqueeze(1)) * isum.float()
    if format == "q4_1":
        m = b[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)  # [N, nb]
        v = v + (m.unsqueeze(0) * dx.unsqueeze(1)) * qx.sum(-1).float().unsqueeze(1)
    acc = torch.zeros(*v.shape[:2], QX_LANES)
    for blk in range(nb):
        acc[..., blk % QX_LANES] += v[..., blk]
    acc = acc[..., :4] + acc[..., 4:]
    acc = acc[..., :2] + acc[..., 2:]
    y = acc[..., 0] + acc[..., 1]  # [M, N]
    if bias is not None:
        y = y + bias.float()
    if residual is not None:
        y = y + residual.reshape(-1, N).float()
    return y.to(x.dtype).reshape(*lead, N)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Reference of ``poss::rms_norm``: HF Llama RMSNorm, statistics in fp32."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    """Reference of ``poss::add_rms_norm``: (rms_norm(x + residual), x + residual)."""
    s = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(s, weight, eps), s


def swiglu(gate_up: Tensor) -> Tensor:
    """Reference of ``poss::swiglu``: silu(gate) * up for gate_up = [gate | up]."""
    g, u = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(gate_up.dtype)


def rope_rotate(x: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """Rotate-half RoPE of ``x [B, T, H, D]`` at ``positions [B, T]``, in fp32."""
    ang = positions.float().unsqueeze(-1) * inv_freq.float()  # [B, T, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).unsqueeze(2)
    sin = torch.cat([ang.sin(), ang.sin()], -1).unsqueeze(2)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


def rope_qkv(qkv: Tensor, positions: Tensor, inv_freq: Tensor, k_cache: Tensor, v_cache: Tensor,
             start: Tensor, num_heads: int, num_kv_heads: int) -> Tensor:
    """Reference of ``poss::rope_qkv``; see ``poss_ext.ops.rope_qkv``."""
    B, T, _ = qkv.shape
    D = k_cache.shape[-1]
    q, k, v = qkv.view(B, T, num_heads + 2 * num_kv_heads, D).split(
        [num_heads, num_kv_heads, num_kv_heads], dim=2)
    q = rope_rotate(q, positions, inv_freq)
    k = rope_rotate(k, positions, inv_freq)
    for b in range(B):
        s = int(start[b])
        if s < 0 or s + T > k_cache.shape[2]:
            raise RuntimeError(f"start[{b}] + T must lie within the cache (S = {k_cache.shape[2]})")
        k_cache[b, :, s:s + T] = k[b].transpose(0, 1)
        v_cache[b, :, s:s + T] = v[b].transpose(0, 1)
    return q.transpose(1, 2).contiguous()


def decoder_layer(x, in_norm_w, w_qkv, b_qkv, w_o, post_norm_w, w_gate_up, w_down, k_cache, v_cache,
                  prefix_len, parents, positions, inv_freq, num_heads, num_kv_heads, eps):
    """Reference of ``poss::decoder_layer``, built from the other references in this module."""
    B, T, H = x.shape
    D = k_cache.shape[-1]
    N = parents.shape[1]
    a = rms_norm(x, in_norm_w, eps) if in_norm_w is not None else x
    qkv = torch.nn.functional.linear(a, w_qkv, b_qkv)
    start = (prefix_len + (N - T)).to(torch.int32)
    q = rope_qkv(qkv, positions, inv_freq, k_cache, v_cache, start, num_heads, num_kv_heads)
    attn = tree_attention(q, k_cache, v_cache, prefix_len, parents, D ** -0.5)
    o = attn.transpose(1, 2).reshape(B, T, num_heads * D) @ w_o.t()
    m_in, h = add_rms_norm(o, x, post_norm_w, eps)
    return h + swiglu(m_in @ w_gate_up.t()) @ w_down.t()


def specialist_forward(embeds, features, fc_w, fc_b, w_qkv, w_o, post_norm_w, w_gate_up, w_down,
                       k_cache, v_cache, prefix_len, parents, positions, inv_freq, num_heads,
                       num_kv_heads, eps):
    """Reference of ``poss::specialist_forward``: fc([embeds; features]) then a norm-free decoder layer."""
    u = torch.nn.functional.linear(torch.cat([embeds, features], -1), fc_w, fc_b)
    return decoder_layer(u, None, w_qkv, None, w_o, post_norm_w, w_gate_up, w_down, k_cache, v_cache,
                         prefix_len, parents, positions, inv_freq, num_heads, num_kv_heads, eps)


def eagle3_layer_forward(embeds, hidden, input_norm_w, hidden_norm_w, w_qkv, w_o, post_norm_w, w_gate_up, w_down,
                         k_cache, v_cache, prefix_len, parents, positions, inv_freq, num_heads, num_kv_heads, eps):
    """Reference of ``poss::eagle3_layer_forward``: q/k/v over [norm(embeds); norm(hidden)], residual hidden."""
    B, T, H = hidden.shape
    D = k_cache.shape[-1]
    N = parents.shape[1]
    a = torch.cat([rms_norm(embeds, input_norm_w, eps), rms_norm(hidden, hidden_norm_w, eps)], -1)
    qkv = torch.nn.functional.linear(a, w_qkv)
    start = (prefix_len + (N - T)).to(torch.int32)
    q = rope_qkv(qkv, positions, inv_freq, k_cache, v_cache, start, num_heads, num_kv_heads)
    attn = tree_attention(q, k_cache, v_cache, prefix_len, parents, D ** -0.5)
    o = attn.transpose(1, 2).reshape(B, T, num_heads * D) @ w_o.t()
    m_in, h = add_rms_norm(o, hidden, post_norm_w, eps)
    return h + swiglu(m_in @ w_gate_up.t()) @ w_down.t()
