"""The PosS draft: a shared fusion layer ``fc`` plus N position specialists (PosS paper §1).

Specialist j is a Llama decoder layer without input norm, with its own q/k/v/o, post-attention
RMSNorm, SwiGLU MLP and KV cache. The embedding and lm_head are the target's (shared, never copied
or saved). Weights are stored packed (q|k|v rows, gate|up rows) so the fused
``poss::specialist_forward`` runs on them directly; switching specialists passes another weight set.
"""

from pathlib import Path
from typing import Dict, Optional

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

import poss_ext
from poss.models.attention import dense_tree_attention, ensure_tree_attention
from poss.models.draft_config import DraftConfig
from poss.models.kv_cache import StaticKVCache


class Specialist(nn.Module):
    """One specialist's weights; :meth:`forward` is the plain eager reference of the fused op."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.c = c
        q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
        self.qkv_proj = nn.Linear(c.hidden, q + 2 * kv, bias=False)
        self.o_proj = nn.Linear(q, c.hidden, bias=False)
        self.post_norm = nn.Parameter(torch.ones(c.hidden))
        self.gate_up_proj = nn.Linear(c.hidden, 2 * c.ffn, bias=False)
        self.down_proj = nn.Linear(c.ffn, c.hidden, bias=False)

    def fused_weights(self):
        return (self.qkv_proj.weight, self.o_proj.weight, self.post_norm, self.gate_up_proj.weight,
                self.down_proj.weight)

    def forward(self, u: Tensor, k_cache: Tensor, v_cache: Tensor, prefix_len: Tensor, parents: Tensor,
                positions: Tensor, inv_freq: Tensor) -> Tensor:
        """Eager decoder layer (no input norm) over ``u [B, T, H]``; writes K/V like the fused op."""
        c = self.c
        B, T, _ = u.shape
        N = parents.shape[1]
        q, k, v = self.qkv_proj(u).view(B, T, -1, c.head_dim).split([c.heads, c.kv_heads, c.kv_heads], 2)
        ang = positions.float().unsqueeze(-1) * inv_freq
        cos, sin = torch.cat([ang.cos()] * 2, -1).unsqueeze(2), torch.cat([ang.sin()] * 2, -1).unsqueeze(2)

        def rot(x):
            x1, x2 = x.float().chunk(2, -1)
            return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)

        q, k = rot(q), rot(k)
        slots = (prefix_len.long() + N - T).view(B, 1) + torch.arange(T, device=u.device)
        for b in range(B):
            k_cache[b, :, slots[b]] = k[b].transpose(0, 1)
            v_cache[b, :, slots[b]] = v[b].transpose(0, 1)
        attn = dense_tree_attention(q.transpose(1, 2), k_cache, v_cache, prefix_len, parents, c.head_dim ** -0.5)
        h = u + self.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        hf = h.float()
        normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + c.rms_eps) * self.post_norm.float()).to(h.dtype)
        gate, up = self.gate_up_proj(normed).chunk(2, -1)
        return h + self.down_proj(nn.functional.silu(gate) * up)


class PosSDraft(nn.Module):
    """PosS draft model; ``n_specialists = 1`` is EAGLE-2 / HASS."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden, config.hidden, bias=config.fc_bias)
        self.layers = nn.ModuleList(Specialist(config) for _ in range(config.n_specialists))
        if config.draft_vocab:
            # Reduced vocabulary: full-vocabulary ids of the K tokens the draft scores (saved with the weights).
            self.register_buffer("token_map", torch.zeros(config.draft_vocab, dtype=torch.int64))
        else:
            self.token_map = None
        self._head: Optional[Tensor] = None  # the lm_head rows the draft scores, cached at attach
        self._target = None  # (embed [V, H], lm_head [V, H], inv_freq [D/2]) borrowed from the target
        self.caches: Optional[StaticKVCache] = None

    # -- target binding --------------------------------------------------------------------------
    def attach(self, runner, max_batch: int, max_seq: int) -> "PosSDraft":
        """Share the target runner's embedding, lm_head and RoPE, and allocate one KV cache per specialist.

        Raises ``ValueError`` when the runner's weights are not those this draft was made for.
        """
        fp = runner.fingerprint()
        if self.config.target_fingerprint and fp != self.config.target_fingerprint:
            raise ValueError(
                f"this draft was built for target {self.config.target_name!r} (weights {self.config.target_fingerprint}), "
                f"but the runner holds different weights ({fp}); load the matching target")
        if runner.hidden_size != self.config.hidden:
            raise ValueError(f"draft hidden {self.config.hidden} != target hidden {runner.hidden_size}")
        return self.attach_tensors(runner.embed, runner.lm_head, runner.inv_freq, max_batch, max_seq)

    def attach_tensors(self, embed: Tensor, lm_head: Tensor, inv_freq: Tensor, max_batch: int,
                       max_seq: int) -> "PosSDraft":
        """:meth:`attach` without the target check: embed / lm_head ``[V, H]``, inv_freq ``[D/2] float32``."""
        ensure_tree_attention()
        self._target = (embed, lm_head, inv_freq)
        self._head = self.head_rows(lm_head)
        p = next(self.parameters())
        self.caches = StaticKVCache(self.config.n_specialists, max_batch, self.config.kv_heads, max_seq,
                                    self.config.head_dim, p.dtype, p.device)
        return self

    @property
    def target(self):
        if self._target is None:
            raise RuntimeError("attach() the draft to a target runner first")
        return self._target

    def specialist_for(self, position: int) -> int:
        return self.config.specialist_for(position)

    # -- forward ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, j: int, tokens: Tensor, features: Tensor, positions: Tensor, parents: Tensor,
             prefix_len: Tensor) -> Tensor:
        """Fused forward of specialist j over T new tokens (the last T nodes of ``parents``).

        tokens ``[B, T] int64`` (x_{t+1}), features ``[B, T, H]`` (f_t), positions ``[B, T] int64``,
        parents ``[B, N] int32``, prefix_len ``[B] int32`` (specialist j's committed length).
        Returns the output features ``[B, T, H]``; use :meth:`logits` for the token distribution.
        """
        embed, _, inv_freq = self.target
        B = tokens.shape[0]
        self.caches.check_fits(prefix_len, parents.shape[1])
        k, v = self.caches.layer(j)
        e = nn.functional.embedding(tokens, embed).to(features.dtype)
        return poss_ext.ops.specialist_forward(
            e, features, self.fc.weight, self.fc.bias, *self.layers[j].fused_weights(), k[:B], v[:B],
            prefix_len, parents, positions, inv_freq, self.config.heads, self.config.kv_heads, self.config.rms_eps)

    def eager_step(self, j, tokens, features, positions, parents, prefix_len) -> Tensor:
        """The same computation as :meth:`step` with plain PyTorch modules (differentiable)."""
        embed, _, inv_freq = self.target
        B = tokens.shape[0]
        k, v = self.caches.layer(j)
        e = nn.functional.embedding(tokens, embed).to(features.dtype)
        u = self.fc(torch.cat([e, features], -1))
        return self.layers[j](u, k[:B], v[:B], prefix_len, parents, positions, inv_freq)

    def head_rows(self, lm_head: Tensor) -> Tensor:
        """The rows of the target's ``lm_head [V, H]`` this draft scores: ``[K, H]`` (all V without a token map)."""
        if self.token_map is None:
            return lm_head
        return lm_head.index_select(0, self.token_map.to(lm_head.device))

    def logits(self, out_features: Tensor) -> Tensor:
        """Target lm_head over the specialist output (no norm in between): ``[..., K]`` over the draft
        vocabulary (``K = V`` without a token map; map indices back with :meth:`full_ids`)."""
        self.target  # noqa: B018  (raises when not attached)
        return out_features @ self._head.t().to(out_features.dtype)

    def full_ids(self, index: Tensor) -> Tensor:
        """Full-vocabulary token ids of draft-vocabulary indices (identity without a token map)."""
        return index if self.token_map is None else self.token_map[index]

    # -- persistence -----------------------------------------------------------------------------
    def save(self, directory) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.config.save(d / "config.json")
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(d / "model.safetensors"))

    @classmethod
    def load(cls, directory, dtype: torch.dtype = torch.float32, device="cpu") -> "PosSDraft":
        d = Path(directory)
        model = cls(DraftConfig.load(d / "config.json"))
        model.load_state_dict(load_file(str(d / "model.safetensors")), strict=True)
        return model.to(dtype=dtype, device=device).eval()

    @classmethod
    def from_eagle(cls, state_dict: Dict[str, Tensor], config: DraftConfig) -> "PosSDraft":
        """Initialise every specialist from a single-layer EAGLE checkpoint (as the PosS paper does).

        ``state_dict`` uses EAGLE's names: ``fc.*``, ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
        ``layers.0.post_attention_layernorm.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``;
        its ``embed_tokens`` is ignored (the target's is shared).
        """
        model = cls(config)
        p = "layers.0."
        try:
            sd = {"fc.weight": state_dict["fc.weight"]}
            if config.fc_bias:
                sd["fc.bias"] = state_dict["fc.bias"]
            layer = {
                "qkv_proj.weight": torch.cat([state_dict[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
                "o_proj.weight": state_dict[p + "self_attn.o_proj.weight"],
                "post_norm": state_dict[p + "post_attention_layernorm.weight"],
                "gate_up_proj.weight": torch.cat([state_dict[p + "mlp.gate_proj.weight"],
                                                  state_dict[p + "mlp.up_proj.weight"]]),
                "down_proj.weight": state_dict[p + "mlp.down_proj.weight"],
            }
        except KeyError as e:
            raise ValueError(f"not a single-layer EAGLE checkpoint: missing {e}") from None
        for j in range(config.n_specialists):
            sd.update({f"layers.{j}.{k}": v.clone() for k, v in layer.items()})
        model.load_state_dict(sd, strict=True)
        return model
