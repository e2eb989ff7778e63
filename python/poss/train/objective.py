"""One objective for EAGLE-2, HASS and PosS-n (poss-algorithm.md §2.3-2.4).

A method is ``(steps, positions_per_specialist)``: EAGLE-2 = (1, 1), HASS = (3, n=1 specialist),
PosS-n = (S, n). Step k runs specialist ``min(k // n, N - 1)`` over feature levels 0..k: level 0 is the
true (noised) feature, level l the detached, right-shifted prediction of step l - 1. Every step's
target is the true next feature f_{t+1} and the target's distribution over x_{t+2}. Each step is
backpropagated on its own (gradients accumulate), as in the reference, so only one step's graph is
alive at a time.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from poss.models.draft import PosSDraft
from poss.train.aligned_attention import aligned_attention


@dataclass
class Objective:
    steps: int = 1
    v_weight: float = 1.0
    p_weight: float = 0.1
    topk_weight: float = 0.0
    topk: int = 10


def rope_tables(inv_freq: Tensor, L: int, dtype) -> tuple:
    ang = torch.arange(L, device=inv_freq.device, dtype=torch.float32).unsqueeze(-1) * inv_freq
    ang = torch.cat([ang, ang], -1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def specialist_levels(draft: PosSDraft, j: int, embeds: Tensor, levels: List[Tensor], cos: Tensor,
                      sin: Tensor) -> Tensor:
    """Differentiable step of specialist j over feature levels: returns g ``[B, L, H]``.

    embeds ``[B, L, H]`` = Embed(x_{t+1}); levels: ``k + 1`` tensors ``[B, L, H]``. Query and residual
    come from the newest level; keys/values of every level from specialist j's projections.
    """
    c, sp = draft.config, draft.layers[j]
    B, L, _ = embeds.shape
    nq, nkv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    us = [draft.fc(torch.cat([embeds, lv.to(embeds.dtype)], -1)) for lv in levels]
    keys, values = [], []
    for i, u in enumerate(us):
        qkv = sp.qkv_proj(u)
        if i == len(us) - 1:
            q = _rope(qkv[..., :nq].view(B, L, c.heads, c.head_dim).transpose(1, 2), cos, sin)
        keys.append(_rope(qkv[..., nq:nq + nkv].view(B, L, c.kv_heads, c.head_dim).transpose(1, 2), cos, sin))
        values.append(qkv[..., nq + nkv:].view(B, L, c.kv_heads, c.head_dim).transpose(1, 2))
    attn = aligned_attention(q, keys, values, c.head_dim ** -0.5)
    h = us[-1] + sp.o_proj(attn.transpose(1, 2).reshape(B, L, nq))
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + c.rms_eps) * sp.post_norm.float()
    gate, up = sp.gate_up_proj(normed.to(h.dtype)).chunk(2, -1)
    return h + sp.down_proj(F.silu(gate) * up)


@dataclass
class Batch:
    """Shifted training tensors (poss-algorithm.md §2.2), all ``[B, L, ...]``; row t pairs f_t with x_{t+1}."""

    tokens: Tensor  # x_{t+1}, int64
    features: Tensor  # f_t (noise added on the train split)
    target: Tensor  # f_{t+1}
    row_mask: Tensor  # bool: row t is trained (x_{t+1} is an assistant token and f_{t+1} exists)
    target_logp: Tensor  # [M, V] float32 log-softmax of lm_head(f_{t+1}) at the M masked rows


def make_batch(input_ids: Tensor, loss_mask: Tensor, lengths: Tensor, features: Tensor, lm_head: Tensor,
               noise_std: float = 0.0, generator: Optional[torch.Generator] = None) -> Batch:
    """Build the shifted batch from right-padded ``[B, L]`` tokens/mask, ``lengths [B]`` and features ``[B, L, H]``.

    ``noise_std > 0`` adds EAGLE's uniform noise scaled by 512 / L per sample."""
    B, L = input_ids.shape
    zero = torch.zeros(B, 1, dtype=input_ids.dtype, device=input_ids.device)
    tokens = torch.cat([input_ids[:, 1:], zero], 1)
    target = torch.cat([features[:, 1:], torch.zeros_like(features[:, :1])], 1)
    row_mask = torch.cat([loss_mask[:, 1:], zero], 1).bool()
    feats = features
    if noise_std > 0:
        scale = (noise_std * 512.0 / lengths.float()).view(B, 1, 1).to(features.device)
        u = torch.rand(features.shape, generator=generator, device=features.device)
        feats = (features.float() + (u - 0.5) * scale).to(features.dtype)
    with torch.no_grad():
        t = target[row_mask]
        target_logp = torch.log_softmax((t @ lm_head.t().to(t.dtype)).float(), -1)
    return Batch(tokens, feats, target, row_mask, target_logp)


def step_losses(g: Tensor, batch: Batch, lm_head: Tensor, obj: Objective) -> Dict[str, Tensor]:
    """Losses of one step at the masked rows (sums normalised by M + 1e-5, as in the reference)."""
    m = batch.row_mask
    M = m.sum()
    gm = g[m]
    tm = batch.target[m].to(gm.dtype)
    denom = M.float() + 1e-5
    vloss = F.smooth_l1_loss(gm.float(), tm.float(), reduction="none").mean(-1).sum() / denom
    logq = torch.log_softmax((gm @ lm_head.t().to(gm.dtype)).float(), -1)
    p = batch.target_logp.exp()
    ploss = -(p * logq).sum() / denom
    loss = obj.v_weight * vloss + obj.p_weight * ploss
    out = {"vloss": vloss.detach(), "ploss": ploss.detach()}
    if obj.topk_weight > 0:
        top_p, top_i = p.topk(obj.topk, -1)
        tloss = -(top_p * logq.gather(-1, top_i)).sum() / denom
        loss = loss + obj.topk_weight * tloss
        out["topkloss"] = tloss.detach()
    with torch.no_grad():
        out["correct"] = (logq.argmax(-1) == batch.target_logp.argmax(-1)).sum()
        out["count"] = M
    out["loss"] = loss
    return out


def run_steps(draft: PosSDraft, batch: Batch, embed: Tensor, lm_head: Tensor, inv_freq: Tensor, obj: Objective,
              backward: bool = True, autocast_dtype: Optional[torch.dtype] = torch.bfloat16,
              keep_outputs: bool = False) -> List[Dict[str, Tensor]]:
    """All ``obj.steps`` steps on one batch; with ``backward`` each step's loss is backpropagated.

    Returns per-step metric dicts (loss tensors detached; ``keep_outputs`` adds each step's
    prediction ``g [B, L, H]`` and its input ``levels``).
    """
    c = draft.config
    B, L = batch.tokens.shape
    dev = batch.features.device
    cos, sin = rope_tables(inv_freq.to(dev), L, torch.float32)
    levels = [batch.features]
    out = []
    ppl, n = c.positions_per_specialist, c.n_specialists
    for k in range(obj.steps):
        j = min(k // ppl, n - 1)
        ctx = torch.autocast(dev.type, dtype=autocast_dtype) if autocast_dtype else torch.autocast(dev.type, enabled=False)
        with ctx:
            embeds = F.embedding(batch.tokens, embed).to(torch.float32)
            g = specialist_levels(draft, j, embeds, levels, cos, sin)
            m = step_losses(g, batch, lm_head, obj)
        if backward:
            m["loss"].backward()
        m["loss"] = m["loss"].detach()
        if keep_outputs:
            m["g"], m["levels"] = g.detach(), list(levels)
        out.append(m)
        if k + 1 < obj.steps:
            # Next level: the prediction for row t becomes the input feature of row t + 1; row 0 keeps f_0.
            prev = levels[-1]
            levels.append(torch.cat([prev[:, :1], g[:, :-1].to(prev.dtype)], 1).detach())
    return out
