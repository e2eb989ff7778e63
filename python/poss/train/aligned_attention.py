"""HASS / PosS aligned multi-step attention without materialising the ``[F, L, L]`` logits.

At training step k (F = k + 1 feature levels) query row r sees
  * level 0 (true features): columns ``j <= r - k`` -- causal attention shifted by k;
  * level l >= 1 (the draft's own detached predictions): exactly column ``r - (k - l)``.
So the computation splits into one causal attention over level 0 plus k row-wise dot products,
merged by log-sum-exp. Masked columns are excluded with -inf (the published reference code lets them in with a 0 logit;
that leak is deliberately not reproduced). :func:`naive_aligned_attention` is the dense
masked version the tests compare against.
"""

import math
from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


def _acc(t: Tensor) -> torch.dtype:
    # Softmax statistics in fp32 for half inputs, in the input's precision otherwise (fp64 tests).
    return torch.promote_types(t.dtype, torch.float32)


def _expand_kv(x: Tensor, heads: int) -> Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def causal_attention_lse(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tuple[Tensor, Tensor]:
    """Causal attention that also returns the log-sum-exp of each row's logits (differentiable in both).

    q ``[B, H, L, D]``, k/v ``[B, H, L, D]`` (row i sees columns <= i). Returns out ``[B, H, L, D]``
    and lse ``[B, H, L]`` in float32. Scores are kept per level only (``[B, H, L, L]``), never per step.
    """
    L = q.shape[2]
    s = torch.matmul(q, k.transpose(-1, -2)).to(_acc(q)) * scale
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(p.to(v.dtype), v), lse


def aligned_attention(q: Tensor, keys: List[Tensor], values: List[Tensor], scale: float = None) -> Tensor:
    """Aligned attention of step k = ``len(keys) - 1``.

    Args:
        q: ``[B, H, L, D]`` queries from the newest level.
        keys, values: per level l = 0..k, ``[B, Hkv, L, D]`` (Hkv divides H; GQA is expanded here).
    Returns:
        ``[B, H, L, D]`` in q's dtype. Rows r < k have no level-0 column and attend only to the
        diagonal entries that exist (r - (k - l) >= 0); row 0 always has at least its own column.
    """
    B, H, L, D = q.shape
    k_steps = len(keys) - 1
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    if k_steps == 0:  # EAGLE-2 / step 0: plain causal attention, no merge needed; use the fused kernel
        return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True, scale=scale,
                                              enable_gqa=keys[0].shape[1] != H)
    neg_inf = torch.tensor(float("-inf"), device=q.device)
    # Level 0: rows k.. attend causally to columns ..L-1-k (the same square causal pattern, shifted).
    lse0 = torch.full((B, H, L), float("-inf"), device=q.device, dtype=_acc(q))
    out0 = torch.zeros(B, H, L, D, device=q.device, dtype=q.dtype)
    if k_steps < L:
        o, lse = causal_attention_lse(q[:, :, k_steps:], _expand_kv(keys[0], H)[:, :, : L - k_steps],
                                      _expand_kv(values[0], H)[:, :, : L - k_steps], scale)
        out0 = torch.cat([out0[:, :, :k_steps], o.to(q.dtype)], 2)
        lse0 = torch.cat([lse0[:, :, :k_steps], lse], 2)
    # Levels 1..k: row r pairs with column r - d, d = k - l, i.e. the level shifted down by d rows.
    diag_scores, diag_values = [], []
    rows = torch.arange(L, device=q.device)
    for level in range(1, k_steps + 1):
        d = k_steps - level
        if d >= L:
            continue  # no row reaches this level's diagonal
        kl, vl = _expand_kv(keys[level], H), _expand_kv(values[level], H)
        if d:
            kl = F.pad(kl[:, :, : L - d], (0, 0, d, 0))
            vl = F.pad(vl[:, :, : L - d], (0, 0, d, 0))
        s = (q * kl).sum(-1).to(_acc(q)) * scale
        diag_scores.append(torch.where(rows >= d, s, neg_inf))
        diag_values.append(vl)
    if not diag_scores:
        return out0
    all_lse = torch.stack([lse0] + diag_scores, 0)  # [F, B, H, L]: F row scalars, not F x L x L
    total = torch.logsumexp(all_lse, 0)
    w = torch.exp(all_lse - total)  # exp(-inf) = 0 for absent columns / empty level 0
    out = w[0].unsqueeze(-1) * out0.to(w.dtype)
    for i, vl in enumerate(diag_values):
        out = out + w[i + 1].unsqueeze(-1) * vl.to(w.dtype)
    return out.to(q.dtype)


def align_masks(k_steps: int, L: int, device=None) -> Tensor:
    """``[F, L, L] bool`` visibility of each level at step k (the reference's "align masks")."""
    r = torch.arange(L, device=device).view(L, 1)
    j = torch.arange(L, device=device).view(1, L)
    masks = [j <= r - k_steps]
    for level in range(1, k_steps + 1):
        masks.append(j == r - (k_steps - level))
    return torch.stack(masks)


def naive_aligned_attention(q: Tensor, keys: List[Tensor], values: List[Tensor], scale: float = None) -> Tensor:
    """Dense reference: ``[F, B, H, L, L]`` logits, -inf masked, one softmax over all levels' columns."""
    B, H, L, D = q.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    masks = align_masks(len(keys) - 1, L, q.device)
    s = torch.stack([torch.matmul(q, _expand_kv(k, H).transpose(-1, -2)).to(_acc(q)) * scale for k in keys])
    s = s.masked_fill(~masks[:, None, None], float("-inf"))
    Fl = s.shape[0]
    p = torch.softmax(s.permute(1, 2, 3, 0, 4).reshape(B, H, L, Fl * L), -1)
    p = p.view(B, H, L, Fl, L).permute(3, 0, 1, 2, 4)
    out = sum(torch.matmul(p[i], _expand_kv(values[i], H).to(p.dtype)) for i in range(Fl))
    return out.to(q.dtype)
