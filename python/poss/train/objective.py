"""One objective for EAGLE-2, HASS and PosS-n (docs/algorithm.md §2.3-2.4).

A method is ``(steps, positions_per_specialist)``: EAGLE-2 = (1, 1), HASS = (3, n=1 specialist),
PosS-n = (S, n). Step k runs specialist ``min(k // n, N - 1)`` over feature levels 0..k: level 0 is the
true (noised) feature, level l the detached, right-shifted prediction of step l - 1. Every step's
target is the true next feature f_{t+1} and the target's distribution over x_{t+2}. Each step is
backpropagated on its own (gradients accumulate), as in the reference, so only one step's graph is
alive at a time.

EAGLE-3 features (``DraftConfig.features == "eagle3"``, EAGLE-3 and PosS on EAGLE-3 features) train
with EAGLE-3's training-time test instead (:func:`run_eagle3_steps`): level 0 is ``fc`` over the
target layers, level l the draft's own output of step l - 1 (right-shifted as above, NOT detached:
gradients flow back through the unrolled steps), the loss is only the soft cross-entropy of the
draft's own ``lm_head(norm(h))`` against the target's distribution over the draft vocabulary, each step
weighted (``0.8 ** k`` by default), and one backward runs over all steps.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from poss.models.draft import PosSDraft
from poss.models.specialist import eagle3_inputs, fuse, rms_norm, rope_tables
from poss.train.aligned_attention import aligned_attention


@dataclass
class Objective:
    steps: int = 1
    v_weight: float = 1.0
    p_weight: float = 0.1
    topk_weight: float = 0.0
    topk: int = 10
    chunk: int = 128  # rows per lm_head chunk in the distillation loss
    # Loss weight of step k (drafting position k + 1); None: 1 for every step, as in the paper.
    position_weights: Optional[List[float]] = None

    def weight(self, k: int) -> float:
        return 1.0 if self.position_weights is None else float(self.position_weights[k])


def position_weights(spec: str, steps: int) -> Optional[List[float]]:
    """The per-step loss weights a ``--position-weights`` value names, or None for uniform.

    ``uniform``; ``eagle3``: ``0.8 ** k`` (EAGLE-3's decay); ``reach:a1,a2,...``: the chance a round
    reaches each position given measured pos-acc rates ``a_i`` (weight of position n = a_1 ... a_{n-1},
    so position 1 weighs 1); or ``w1,w2,...``: one weight per step. Raises ``ValueError`` naming the form.
    """
    spec = spec.strip()
    if spec == "uniform":
        return None
    if spec == "eagle3":
        return [0.8 ** k for k in range(steps)]
    try:
        if spec.startswith("reach:"):
            acc = [float(x) for x in spec[len("reach:"):].split(",")]
            if len(acc) < steps - 1 or not all(0 < a <= 1 for a in acc):
                raise ValueError
            w = [1.0]
            for a in acc[:steps - 1]:
                w.append(w[-1] * a)
            return w
        w = [float(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(f"position weights {spec!r}: expected uniform, eagle3, reach:a1,...,a{steps - 1} "
                         f"(pos-acc rates in (0, 1]) or {steps} comma-separated weights") from None
    if len(w) != steps or not all(x >= 0 for x in w) or not any(w):
        raise ValueError(f"position weights {spec!r}: expected {steps} non-negative weights, not all zero")
    return w


def specialist_levels(draft: PosSDraft, j: int, embeds: Tensor, levels: List[Tensor], cos: Tensor,
                      sin: Tensor) -> Tensor:
    """Differentiable step of specialist j over feature levels: returns g ``[B, L, H]`` in ``embeds.dtype``.

    embeds ``[B, L, H]`` = Embed(x_{t+1}) in the compute dtype (bf16 for mixed precision, else fp32);
    levels: ``k + 1`` tensors ``[B, L, H]``; cos / sin ``[L, D] float32``. This is the draft's own eager
    specialist (:class:`poss.models.specialist.Specialist`) with aligned attention over the levels in
    place of tree attention over a KV cache.
    """
    us = fuse(draft.fc_for(j), embeds, levels)
    return draft.layers[j].layer(us, cos, sin, aligned_attention)


@dataclass
class Batch:
    """Shifted training tensors (docs/algorithm.md §2.2), all ``[B, L, ...]``; row t pairs f_t with x_{t+1}."""

    tokens: Tensor  # x_{t+1}, int64
    features: Tensor  # f_t (noise added on the train split)
    target: Tensor  # f_{t+1}
    row_mask: Tensor  # bool: row t is trained (x_{t+1} is an assistant token and f_{t+1} exists)
    target_p: Tensor  # [M, K] float32 softmax of lm_head(f_{t+1}) at the M masked rows (K = V, or the draft vocabulary)
    target_top1: Tensor  # [M] int64 argmax of the same logits; -1 where the target token is outside the
    #                      draft vocabulary
    ce_keep: Optional[Tensor] = None  # [M] bool: rows in the classification loss (None: all)


def make_batch(input_ids: Tensor, loss_mask: Tensor, lengths: Tensor, features: Tensor, lm_head: Tensor,
               noise_std: float = 0.0, generator: Optional[torch.Generator] = None,
               token_map: Optional[Tensor] = None, next_token: Optional[Tensor] = None) -> Batch:
    """Build the shifted batch from right-padded ``[B, L]`` tokens/mask, ``lengths [B]`` and features ``[B, L, H]``
    (or the runner's wider ``[B, L, W]`` with target layers after the first H final-norm columns: the
    targets come from those H, the inputs keep all W).

    ``noise_std > 0`` adds EAGLE's uniform noise scaled by 512 / L per sample.

    ``token_map [K] int64`` (a reduced draft vocabulary): the target side is computed over those K
    lm_head rows only (its distribution restricted to them and renormalised); the target token of
    row t is the data's ``x_{t+2}`` (on-policy data: the target's own greedy choice; for the row
    before the last, ``next_token [B]``, -1 or None when unknown), and rows whose token is outside the
    K, or unknown, leave the classification loss and count as misses in the accuracy."""
    B, L = input_ids.shape
    zero = torch.zeros(B, 1, dtype=input_ids.dtype, device=input_ids.device)
    tokens = torch.cat([input_ids[:, 1:], zero], 1)
    final = features[..., :lm_head.shape[1]]  # the final-norm features (all of them unless wider)
    target = torch.cat([final[:, 1:], torch.zeros_like(final[:, :1])], 1)
    row_mask = torch.cat([loss_mask[:, 1:], zero], 1).bool()
    feats = features
    if noise_std > 0:
        scale = (noise_std * 512.0 / lengths.float()).view(B, 1, 1).to(features.device)
        u = torch.rand(features.shape, generator=generator, device=features.device)
        feats = (features.float() + (u - 0.5) * scale).to(features.dtype)
    with torch.no_grad():
        t = target[row_mask]
        head = lm_head if token_map is None else lm_head.index_select(0, token_map.to(lm_head.device))
        z = t @ head.t().to(t.dtype)
        target_p = torch.softmax(z.float(), -1)
        if token_map is None:
            return Batch(tokens, feats, target, row_mask, target_p, z.argmax(-1))
        from poss.train.draft_vocab import inverse_map

        inv = inverse_map(token_map.to(input_ids.device), lm_head.shape[0])
        dev = input_ids.device
        nxt = torch.cat([input_ids[:, 2:], torch.zeros(B, 2, dtype=input_ids.dtype, device=dev)], 1)
        t2 = torch.arange(L, device=dev).view(1, L) + 2
        n = lengths.to(dev).view(B, 1)
        known = t2 < n
        if next_token is not None:
            after = next_token.to(dev).view(B, 1)
            last = (t2 == n) & (after >= 0)
            nxt = torch.where(last, after, nxt)
            known = known | last
        red = torch.where(known, inv[nxt], torch.full_like(nxt, -1))[row_mask]
        top1 = torch.where(red >= 0, z.argmax(-1), red)
    return Batch(tokens, feats, target, row_mask, target_p, top1, red >= 0)


class HeadDistillation(torch.autograd.Function):
    """Soft cross-entropy (and optional top-K loss) of ``lm_head(g)`` against the target's distribution, in row chunks.

    The ``[M, V]`` logits dominate the draft's training cost on CPU. This never keeps them: each chunk
    of rows computes its logits, loss terms and top-1 agreement, and (when g needs a gradient) the
    logit gradient ``p_w (softmax(z) - p) + topk_w (sum(p_K) softmax(z) - p_K)`` is folded straight
    back through the frozen head into ``grad_g [M, H]``. Temporaries are chunk-sized, so they stay in
    cache, and backward is a single scale of the stored ``grad_g``.

    Returns ``(weighted loss sum, ce sum, topk sum, correct count)``; only the first is differentiable.
    """

    @staticmethod
    def forward(ctx, g: Tensor, head: Tensor, p: Tensor, top1: Tensor, keep: Optional[Tensor], p_weight: float,
                topk_weight: float, topk: int, chunk: int):
        need = ctx.needs_input_grad[0]
        acc = torch.promote_types(g.dtype, torch.float32)  # fp32 logits for bf16 inputs
        w = head.to(g.dtype)
        grad_g = torch.empty(g.shape, dtype=acc, device=g.device) if need else None
        ce = torch.zeros((), dtype=torch.float64, device=g.device)
        tk = torch.zeros((), dtype=torch.float64, device=g.device)
        correct = torch.zeros((), dtype=torch.int64, device=g.device)
        for s in range(0, g.shape[0], chunk):
            e = min(s + chunk, g.shape[0])
            z = (g[s:e] @ w.t()).to(acc)
            pc = p[s:e].to(acc)
            # Few passes over the [chunk, V] block: max, <p, z>, exp in place, sum.
            zmax, arg = z.max(-1, keepdim=True)
            correct += (arg.squeeze(-1) == top1[s:e]).sum()
            pz = torch.linalg.vecdot(pc, z)
            if topk_weight > 0:
                tp, ti = pc.topk(topk, -1)
                tz = z.gather(-1, ti)
            ez = z.sub_(zmax).exp_()  # z is consumed: exp(z - max)
            sumexp = ez.sum(-1, keepdim=True)
            lse = zmax + sumexp.log()
            kw = None if keep is None else keep[s:e].to(acc).unsqueeze(-1)  # rows left out of the loss: 0
            ce += ((lse.squeeze(-1) - pz) if kw is None else (lse.squeeze(-1) - pz) * kw.squeeze(-1)).sum().double()
            if topk_weight > 0:
                tk += -(tp * (tz - lse) * (1 if kw is None else kw)).sum().double()
            if need:
                # softmax = ez / sumexp; d/dz = p_w (softmax - p) + topk_w (sum(p_K) softmax - p_K)
                if topk_weight > 0:
                    dz = ez.mul_((p_weight + topk_weight * tp.sum(-1, keepdim=True)) / sumexp)
                    dz.scatter_add_(-1, ti, -topk_weight * tp)
                    dz.sub_(pc, alpha=p_weight)
                else:
                    dz = ez.div_(sumexp).sub_(pc).mul_(p_weight)
                if kw is not None:
                    dz.mul_(kw)
                grad_g[s:e] = (dz.to(w.dtype) @ w).to(acc)
        ctx.save_for_backward(grad_g)
        ctx.g_dtype = g.dtype
        ctx.mark_non_differentiable(ce, tk, correct)
        loss = (p_weight * ce + topk_weight * tk).float()
        return loss, ce.float(), tk.float(), correct

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        (grad_g,) = ctx.saved_tensors
        return (grad_g * grad_loss).to(ctx.g_dtype), None, None, None, None, None, None, None, None


def step_losses(g: Tensor, batch: Batch, lm_head: Tensor, obj: Objective) -> Dict[str, Tensor]:
    """Losses of one step at the masked rows (sums normalised by M + 1e-5, as in the reference)."""
    m = batch.row_mask
    M = m.sum()
    gm = g[m]
    tm = batch.target[m].to(gm.dtype)
    denom = M.float() + 1e-5
    vloss = F.smooth_l1_loss(gm.float(), tm.float(), reduction="none").mean(-1).sum() / denom
    head_loss, ce, tk, correct = HeadDistillation.apply(gm, lm_head, batch.target_p, batch.target_top1, batch.ce_keep,
                                                        obj.p_weight, obj.topk_weight, obj.topk, obj.chunk)
    loss = obj.v_weight * vloss + head_loss / denom
    out = {"vloss": vloss.detach(), "ploss": ce / denom, "correct": correct, "count": M}
    if obj.topk_weight > 0:
        out["topkloss"] = tk / denom
    out["loss"] = loss
    return out


def run_steps(draft: PosSDraft, batch: Batch, embed: Tensor, lm_head: Tensor, inv_freq: Tensor, obj: Objective,
              backward: bool = True, autocast_dtype: Optional[torch.dtype] = torch.bfloat16,
              keep_outputs: bool = False) -> List[Dict[str, Tensor]]:
    """All ``obj.steps`` steps on one batch; with ``backward`` each step's loss is backpropagated.

    Returns per-step metric dicts (loss tensors detached; ``keep_outputs`` adds each step's
    prediction ``g [B, L, H]`` and its input ``levels``). An ``eagle3`` draft runs :func:`run_eagle3_steps`.
    """
    if draft.config.features == "eagle3":
        return run_eagle3_steps(draft, batch, embed, inv_freq, obj, backward, autocast_dtype, keep_outputs)
    c = draft.config
    B, L = batch.tokens.shape
    dev = batch.features.device
    lm_head = draft.head_rows(lm_head)  # [K, H]: the rows the draft scores
    cos, sin = rope_tables(inv_freq.to(dev), torch.arange(L, device=dev))
    levels = [batch.features]
    out = []
    for k in range(obj.steps):
        j = c.specialist_for(k + 1)  # step k drafts position k + 1
        # Mixed precision by hand: weights are cast once per step inside specialist_levels, which
        # autocast would redo for every level; the loss head takes its dtype from g.
        embeds = F.embedding(batch.tokens, embed).to(autocast_dtype or torch.float32)
        g = specialist_levels(draft, j, embeds, levels, cos, sin)
        m = step_losses(g, batch, lm_head, obj)
        if backward:
            (m["loss"] * obj.weight(k)).backward()  # the reported loss stays unweighted
        m["loss"] = m["loss"].detach()
        if keep_outputs:
            m["g"], m["levels"] = g.detach(), list(levels)
        out.append(m)
        if k + 1 < obj.steps:
            # Next level: the prediction for row t becomes the input feature of row t + 1; row 0 keeps f_0.
            prev = levels[-1]
            levels.append(torch.cat([prev[:, :1], g[:, :-1].to(prev.dtype)], 1).detach())
    return out


def eagle3_step_losses(draft: PosSDraft, h: Tensor, batch: Batch, obj: Objective) -> Dict[str, Tensor]:
    """One training-time-test step's loss at the masked rows: the soft cross-entropy of the draft's own
    ``lm_head(norm(h))`` (``h [B, L, H]``) against ``batch.target_p`` (rows outside the draft vocabulary
    left out), normalised by M + 1e-5, times ``obj.p_weight``; ``correct`` counts the rows whose draft
    argmax is the target's token."""
    m = batch.row_mask
    M = m.sum()
    z = (rms_norm(h[m], draft.norm, draft.config.rms_eps) @ draft.lm_head.weight.to(h.dtype).t()).float()
    rows = -(batch.target_p * torch.log_softmax(z, -1)).sum(-1)
    if batch.ce_keep is not None:
        rows = rows * batch.ce_keep.to(rows.dtype)
    ce = rows.sum() / (M.float() + 1e-5)
    correct = (z.argmax(-1) == batch.target_top1).sum()
    return {"vloss": torch.zeros((), device=h.device), "ploss": ce.detach(), "correct": correct, "count": M,
            "loss": obj.p_weight * ce}


def run_eagle3_steps(draft: PosSDraft, batch: Batch, embed: Tensor, inv_freq: Tensor, obj: Objective,
                     backward: bool = True, autocast_dtype: Optional[torch.dtype] = torch.bfloat16,
                     keep_outputs: bool = False) -> List[Dict[str, Tensor]]:
    """EAGLE-3's training-time test over ``obj.steps`` steps (module docstring), for :func:`run_steps`.

    ``batch.features [B, L, (1 + n) H]``: the runner's features with the draft's n target layers.
    Step k's loss is weighted by ``obj.weight(k)``; with ``backward`` the weighted sum is backpropagated
    once, through every step's fed-back output. Returns per-step metric dicts as :func:`run_steps`
    (``vloss`` 0: no feature regression).
    """
    c = draft.config
    B, L = batch.tokens.shape
    dev = batch.features.device
    cd = autocast_dtype or torch.float32
    cos, sin = rope_tables(inv_freq.to(dev), torch.arange(L, device=dev))
    embeds = F.embedding(batch.tokens, embed).to(cd)
    levels = [draft.draft_input(batch.features).to(cd)]  # g_t = fc(target layers at t)
    out, total = [], None
    for k in range(obj.steps):
        layer = draft.layers[c.specialist_for(k + 1)]
        h = layer.layer(eagle3_inputs(layer, embeds, levels), cos, sin, aligned_attention, residual=levels[-1])
        m = eagle3_step_losses(draft, h, batch, obj)
        total = m["loss"] * obj.weight(k) if total is None else total + m["loss"] * obj.weight(k)
        m["loss"] = m["loss"].detach()
        if keep_outputs:
            m["g"], m["levels"] = h.detach(), [lv.detach() for lv in levels]
        out.append(m)
        if k + 1 < obj.steps:
            # The draft's own output for row t feeds row t + 1 at the next step (row 0 keeps its input).
            levels.append(torch.cat([levels[-1][:, :1], h[:, :-1]], 1))
    if backward:
        total.backward()
    return out
