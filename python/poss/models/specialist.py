"""The position specialist in eager PyTorch, written once for the draft and for training.

A specialist is a Llama decoder layer without input norm (EAGLE's draft layer): the shared fusion
``fc([embed(x_{t+1}); f_t])`` feeds q/k/v with RoPE, attention, ``o_proj`` plus residual, a post-attention
RMSNorm and a SwiGLU MLP. Weights are stored packed (q|k|v rows, gate|up rows) so the fused
``poss::specialist_forward`` op runs on them directly.

Only the attention differs between the two users, so it is a parameter of :meth:`Specialist.layer`:
the draft's eager step (:meth:`Specialist.forward`) attends over a KV cache and a tree
(:func:`poss.models.tree.dense_tree_attention`); training attends over several feature levels at once
(``poss.train.aligned_attention``). ``poss_ext.reference`` keeps an independent copy (the kernels' oracle).

With ``features = "eagle3"`` the specialist is EAGLE-3's layer: q/k/v read
``[input_norm(embed(x_{t+1})); hidden_norm(g_t)]`` (2H features) and the residual is ``g_t``, the fused
target feature or the draft's own previous output (:func:`eagle3_inputs`); ``poss::eagle3_layer_forward``
is its fused op.
"""

from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from poss.models.draft_config import DraftConfig
from poss.models.tree import dense_tree_attention

# attend(q [B, Hq, T, D], keys, values: per level [B, Hkv, T, D], scale) -> [B, Hq, T, D]
Attend = Callable[[Tensor, List[Tensor], List[Tensor], float], Tensor]


def rope_tables(inv_freq: Tensor, positions: Tensor) -> Tuple[Tensor, Tensor]:
    """``cos, sin`` of shape ``positions.shape + (D,)``, float32 (``inv_freq [D/2] float32``)."""
    ang = positions.to(inv_freq.device, torch.float32).unsqueeze(-1) * inv_freq
    ang = torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE of ``x [..., T, D]`` in float32 (as the fused ops do), returned in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, -1)
    return (xf * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


def fuse(fc: nn.Linear, embeds: Tensor, levels: List[Tensor]) -> List[Tensor]:
    """``fc([e; f])`` for each feature level ``f [B, T, H]``, in ``embeds.dtype`` (the compute dtype).

    ``fc([e; f]) = W_e e + W_f f + b``: the token half is the same for every level, so it is computed
    once; the (fp32 master) weights are cast to the compute dtype once per call, not once per level.
    """
    cd = embeds.dtype
    H = embeds.shape[-1]
    w = fc.weight.to(cd)
    e_part = F.linear(embeds, w[:, :H], None if fc.bias is None else fc.bias.to(cd))
    w_f = w[:, H:]
    return [e_part + F.linear(f.to(cd), w_f) for f in levels]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of ``x [..., H]`` in float32, returned in x's dtype (weight cast once)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def eagle3_inputs(layer: "Specialist", embeds: Tensor, levels: List[Tensor]) -> List[Tensor]:
    """An EAGLE-3 specialist's q/k/v inputs ``[B, T, 2H]`` per hidden level ``g [B, T, H]``: the
    normalised embedding (the same for every level, computed once) then the normalised hidden."""
    e = rms_norm(embeds, layer.input_norm, layer.c.rms_eps)
    return [torch.cat([e, rms_norm(g.to(embeds.dtype), layer.hidden_norm, layer.c.rms_eps)], -1) for g in levels]


class Specialist(nn.Module):
    """One specialist's weights plus its eager forward; see the module docstring."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.c = c
        q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
        self.eagle3 = c.features == "eagle3"
        if self.eagle3:  # EAGLE-3: q/k/v over [input_norm(embedding); hidden_norm(hidden)]
            self.input_norm = nn.Parameter(torch.ones(c.hidden))
            self.hidden_norm = nn.Parameter(torch.ones(c.hidden))
        self.qkv_proj = nn.Linear(2 * c.hidden if self.eagle3 else c.hidden, q + 2 * kv, bias=False)
        self.o_proj = nn.Linear(q, c.hidden, bias=False)
        self.post_norm = nn.Parameter(torch.ones(c.hidden))
        self.gate_up_proj = nn.Linear(c.hidden, 2 * c.ffn, bias=False)
        self.down_proj = nn.Linear(c.ffn, c.hidden, bias=False)

    def fused_weights(self):
        """The weights in the order ``poss::specialist_forward`` (``poss::eagle3_layer_forward``: the two
        input norms first) takes them."""
        norms = (self.input_norm, self.hidden_norm) if self.eagle3 else ()
        return norms + (self.qkv_proj.weight, self.o_proj.weight, self.post_norm, self.gate_up_proj.weight,
                        self.down_proj.weight)

    def layer(self, us: List[Tensor], cos: Tensor, sin: Tensor, attend: Attend,
              residual: Optional[Tensor] = None) -> Tensor:
        """The decoder layer over fused inputs ``us`` (one ``[B, T, H]`` per feature level; ``[B, T, 2H]``
        for EAGLE-3, :func:`eagle3_inputs`).

        Queries come from the newest level ``us[-1]``, keys and values from every level; the residual
        is ``residual [B, T, H]`` (EAGLE-3's hidden), by default ``us[-1]``. ``cos``/``sin`` broadcast
        against ``[B, heads, T, D]``. Computes in ``us[-1].dtype`` (weights cast once per call); the
        RMSNorm runs in float32. Returns ``[B, T, H]``.
        """
        c = self.c
        u = us[-1]
        B, T, _ = u.shape
        cd = u.dtype
        nq, nkv = c.heads * c.head_dim, c.kv_heads * c.head_dim
        w_qkv = self.qkv_proj.weight.to(cd)
        q = rope(F.linear(u, w_qkv[:nq]).view(B, T, c.heads, c.head_dim).transpose(1, 2), cos, sin)
        w_kv = w_qkv[nq:]
        keys, values = [], []
        for level in us:
            k, v = F.linear(level, w_kv).split([nkv, nkv], -1)
            keys.append(rope(k.view(B, T, c.kv_heads, c.head_dim).transpose(1, 2), cos, sin))
            values.append(v.view(B, T, c.kv_heads, c.head_dim).transpose(1, 2))
        attn = attend(q, keys, values, c.head_dim ** -0.5)
        h = (u if residual is None else residual.to(cd)) + F.linear(attn.transpose(1, 2).reshape(B, T, nq),
                                                                    self.o_proj.weight.to(cd))
        hf = h.float()
        normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + c.rms_eps) * self.post_norm.float()).to(cd)
        gate, up = F.linear(normed, self.gate_up_proj.weight.to(cd)).chunk(2, -1)
        return h + F.linear(F.silu(gate) * up, self.down_proj.weight.to(cd))

    def forward(self, u: Tensor, k_cache: Tensor, v_cache: Tensor, prefix_len: Tensor, parents: Tensor,
                positions: Tensor, inv_freq: Tensor, residual: Optional[Tensor] = None) -> Tensor:
        """Eager tree step over ``u [B, T, H]`` (``[B, T, 2H]`` with the EAGLE-3 ``residual [B, T, H]``;
        the last T nodes of ``parents [B, N] int32``).

        Writes K/V at slots ``prefix_len + N - T + i`` of ``k_cache``/``v_cache [B, Hkv, S, D]`` exactly as
        the fused op does, then attends over the prefix and each node's ancestors. ``positions [B, T]
        int64``, ``prefix_len [B] int32``, ``inv_freq [D/2] float32``. Returns ``[B, T, H]``.
        """
        B, T, _ = u.shape
        N = parents.shape[1]
        cos, sin = (t.unsqueeze(1) for t in rope_tables(inv_freq, positions))  # [B, 1, T, D]

        def attend(q, keys, values, scale):
            slots = (prefix_len.long() + N - T).view(B, 1) + torch.arange(T, device=u.device)
            for b in range(B):
                k_cache[b, :, slots[b]] = keys[0][b]
                v_cache[b, :, slots[b]] = values[0][b]
            return dense_tree_attention(q, k_cache, v_cache, prefix_len, parents, scale)

        return self.layer([u], cos, sin, attend, residual)
