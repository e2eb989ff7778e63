"""The PosS draft: a fusion layer ``fc`` (shared, or one per specialist) plus N position specialists (PosS paper §1).

Specialist j (:class:`poss.models.specialist.Specialist`) is a Llama decoder layer without input
norm, with its own q/k/v/o, post-attention RMSNorm, SwiGLU MLP and KV cache. The embedding and lm_head
are the target's (shared, never copied or saved). Switching specialists passes another weight set to
the same fused ``poss::specialist_forward`` op.

An ``eagle3`` draft (``DraftConfig.features``, EAGLE-3 and PosS on EAGLE-3 features) differs in three
places: ``fc [H, n*H]`` fuses n target layers' hidden states (no embedding half) into the first step's
input, and deeper steps read the draft's own output instead (:meth:`PosSDraft.draft_input`); each
specialist is EAGLE-3's layer (``poss::eagle3_layer_forward``); and the draft scores with its own final
``norm`` and ``lm_head [K, H]``. The embedding is still the target's.
"""

import os
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

import poss_ext
from poss.huge_pages import pack_on_huge_pages
from poss.models.draft_config import DRAFT_VOCABS, DraftConfig
from poss.models.draft_interop import load_foreign
from poss.models.kv_cache import StaticKVCache
from poss.models.published import layout_of
from poss.models.quant_weight import QuantWeight, project
from poss.models.specialist import Specialist, eagle3_inputs, fuse, rms_norm


class PosSDraft(nn.Module):
    """PosS draft model; ``n_specialists = 1`` is EAGLE-2 / HASS."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        self.eagle3 = config.features == "eagle3"
        if self.eagle3:
            self.fc = nn.Linear(config.n_feature_layers * config.hidden, config.hidden, bias=config.fc_bias)
            # The draft's own final norm and head (EAGLE-3): K rows, the draft vocabulary's (or all V).
            self.norm = nn.Parameter(torch.ones(config.hidden))
            self.lm_head = nn.Linear(config.hidden, config.draft_vocab or config.vocab, bias=False)
        elif config.fc_per_specialist:
            self.fcs = nn.ModuleList(nn.Linear(2 * config.hidden, config.hidden, bias=config.fc_bias)
                                     for _ in range(config.n_specialists))
        else:
            self.fc = nn.Linear(2 * config.hidden, config.hidden, bias=config.fc_bias)
        self.layers = nn.ModuleList(Specialist(config) for _ in range(config.n_specialists))
        if config.draft_vocab:
            # Reduced vocabulary: full-vocabulary ids of the K tokens the draft scores (saved with the weights).
            self.register_buffer("token_map", torch.zeros(config.draft_vocab, dtype=torch.int64))
        else:
            self.token_map = None
        self._head: Optional[Tensor] = None  # the lm_head rows the draft scores, cached at attach
        self._head_blocks: Optional[QuantWeight] = None  # the same rows as GGUF blocks, when the target has them
        self._target = None  # (embed [V, H], lm_head [V, H], inv_freq [D/2]) borrowed from the target
        self.caches: Optional[StaticKVCache] = None

    # -- target binding --------------------------------------------------------------------------
    def attach(self, runner, max_batch: int, max_seq: int) -> "PosSDraft":
        """Share the target runner's embedding, lm_head and RoPE, and allocate one KV cache per specialist.

        Raises ``ValueError`` when the runner's weights are not those this draft was made for.
        """
        self.config.check_target(runner.fingerprint())
        if runner.hidden_size != self.config.hidden:
            raise ValueError(f"draft hidden {self.config.hidden} != target hidden {runner.hidden_size}")
        if runner.lm_head.shape[0] != self.config.vocab:
            raise ValueError(f"draft vocabulary {self.config.vocab} != target vocabulary {runner.lm_head.shape[0]}")
        if self.eagle3:
            want = self.feature_layers_for(len(runner.layers))
            got = getattr(runner, "feature_layers", None)
            if got != want:
                have = f"layers {list(got)}" if got else "only its final-norm features"
                raise ValueError(f"this EAGLE-3 draft fuses the target's hidden states {list(want)}, but the target "
                                 f"runner returns {have}: call runner.set_feature_layers({list(want)}) first "
                                 f"(poss.load does)")
        blocks = getattr(runner, "lm_head_blocks", None)
        return self.attach_tensors(runner.embed, runner.lm_head, runner.inv_freq, max_batch, max_seq,
                                   head_blocks=None if self.eagle3 else blocks)

    def feature_layers_for(self, num_layers: int):
        """The target hidden-state indices an ``eagle3`` draft fuses, for a target of ``num_layers``
        layers (its config's, else EAGLE-3's default); None for a ``last`` draft."""
        if not self.eagle3:
            return None
        from poss.models.target import check_feature_layers, eagle3_feature_layers

        layers = self.config.feature_layers or eagle3_feature_layers(num_layers)
        return check_feature_layers(layers, num_layers)

    def attach_tensors(self, embed: Tensor, lm_head: Tensor, inv_freq: Tensor, max_batch: int,
                       max_seq: int, head_blocks: Optional[QuantWeight] = None) -> "PosSDraft":
        """:meth:`attach` without the target check: embed / lm_head ``[V, H]``, inv_freq ``[D/2] float32``;
        ``head_blocks``: the same lm_head as GGUF blocks (a target loaded with ``dtype="gguf"`` whose file
        quantizes it), which the draft's head then runs instead (:meth:`logits`)."""
        self._target = (embed, lm_head, inv_freq)
        # An EAGLE-3 draft scores with its own lm_head (a parameter: stored here it would be registered twice).
        self._head = None if self.eagle3 else self.head_rows(lm_head)
        # A row of blocks decodes to that row alone (blocks run along K), so gathering whole rows of
        # blocks keeps the file's values exactly, and the head streams the file's bytes, not a float copy.
        self._head_blocks = None
        if head_blocks is not None:
            self._head_blocks = head_blocks
            if self.token_map is not None:
                plain = head_blocks.plain()
                rows = plain.blocks.index_select(0, self.token_map.to(plain.blocks.device))
                self._head_blocks = QuantWeight(rows, plain.format).interleaved()
        if lm_head.device.type == "cpu":
            self._move_weights_to_huge_pages()
        self.caches = None
        self.ensure_caches(max_batch, max_seq)
        return self

    def _move_weights_to_huge_pages(self) -> None:
        # Each round streams the specialists and the head rows once, as the target streams its layers
        # (poss.huge_pages): on 2 MB pages PosS-2's draft phase took ~0.1 ms less (of ~0.9; AVX512-BF16
        # EPYC, one thread). The parameters stay parameters; only their storage moves.
        params = list(self.parameters())
        # Else the head is the target's lm_head, already moved, or an EAGLE-3 draft's own (a parameter).
        own_head = self.token_map is not None and not self.eagle3
        blocks = self._head_blocks is not None and own_head
        heads = ([self._head] if own_head else []) + ([self._head_blocks.blocks] if blocks else [])
        packed = pack_on_huge_pages([p.data for p in params] + heads)
        for p, t in zip(params, packed):
            p.data = t
        if own_head:
            self._head = packed[len(params)]
        if blocks:
            self._head_blocks = QuantWeight(packed[-1], self._head_blocks.format)

    def ensure_caches(self, batch: int, max_seq: int) -> None:
        """Make the specialists' KV caches hold ``batch`` rows of ``max_seq`` slots (contents are lost on growth)."""
        if self.caches is None:
            p = next(self.parameters())
            c = self.config
            self.caches = StaticKVCache.zeros(c.n_specialists, batch, c.kv_heads, max_seq, c.head_dim, p.dtype,
                                              p.device)
        else:
            self.caches = self.caches.grown(batch, max_seq)

    @property
    def target(self):
        if self._target is None:
            raise RuntimeError("attach() the draft to a target runner first")
        return self._target

    def specialist_for(self, position: int) -> int:
        return self.config.specialist_for(position)

    def fc_for(self, j: int) -> nn.Linear:
        """The fusion layer specialist ``j`` runs on (the shared ``fc`` unless each has its own)."""
        return self.fcs[j] if self.config.fc_per_specialist else self.fc

    # -- forward ---------------------------------------------------------------------------------
    def draft_input(self, target_features: Tensor) -> Tensor:
        """What the first draft step reads from the target's features ``[..., W]`` (the runner's
        :meth:`~poss.models.target.TargetRunner.forward` output): a ``last`` draft its first H columns
        (the final-norm feature; all of them when W = H), an ``eagle3`` draft ``fc`` over the last
        ``n * H`` (the n target layers): ``[..., H]`` in the draft's dtype. Differentiable in ``fc``
        when grad is enabled (training); ``ValueError`` when the width does not fit the draft.
        """
        c, W = self.config, target_features.shape[-1]
        if not self.eagle3:
            return target_features if W == c.hidden else target_features[..., :c.hidden]
        n = c.n_feature_layers
        if W != (1 + n) * c.hidden:
            raise ValueError(f"this EAGLE-3 draft reads the final-norm feature plus {n} target layers' hidden "
                             f"states ({(1 + n) * c.hidden} features per token), got {W}: the target runner "
                             f"needs set_feature_layers with {n} layers")
        x = target_features[..., c.hidden:].to(self.fc.weight.dtype)
        if torch.is_grad_enabled() and self.fc.weight.requires_grad:
            return self.fc(x)
        return poss_ext.ops.linear(x.contiguous(), self.fc.weight, self.fc.bias)

    def step(self, j: int, tokens: Tensor, features: Tensor, positions: Tensor, parents: Tensor,
             prefix_len: Tensor, check_capacity: bool = True, eager: bool = False) -> Tensor:
        """Specialist j over T new tokens (the last T nodes of ``parents``), writing its KV cache.

        tokens ``[B, T] int64`` (x_{t+1}), features ``[B, T, H]`` (f_t, target or draft; an ``eagle3``
        draft's: :meth:`draft_input` of the target's, or the draft's own output), positions
        ``[B, T] int64``, parents ``[B, N] int32``, prefix_len ``[B] int32`` (specialist j's committed
        length). Returns the output features ``[B, T, H]``; :meth:`log_probs` gives the distribution.

        ``check_capacity=False`` skips the cache-capacity check, which reads ``prefix_len`` back to the
        host (a device sync); the decoding loop checks capacity once per call itself. ``eager=True``
        runs the same computation with plain PyTorch modules (differentiable, the fused op's reference).
        """
        embed, _, inv_freq = self.target
        B = tokens.shape[0]
        if check_capacity:
            self.caches.check_fits(prefix_len, parents.shape[1])
        k, v = self.caches.layer(j)
        e = nn.functional.embedding(tokens, embed).to(features.dtype)
        c = self.config
        if self.eagle3:
            layer = self.layers[j]
            if eager:
                (a,) = eagle3_inputs(layer, e, [features])
                return layer(a, k[:B], v[:B], prefix_len, parents, positions, inv_freq, residual=features)
            with torch.no_grad():
                return poss_ext.ops.eagle3_layer_forward(
                    e, features, *layer.fused_weights(), k[:B], v[:B], prefix_len, parents, positions, inv_freq,
                    c.heads, c.kv_heads, c.rms_eps)
        fc = self.fc_for(j)
        if eager:
            (u,) = fuse(fc, e, [features])
            return self.layers[j](u, k[:B], v[:B], prefix_len, parents, positions, inv_freq)
        with torch.no_grad():
            return poss_ext.ops.specialist_forward(
                e, features, fc.weight, fc.bias, *self.layers[j].fused_weights(), k[:B], v[:B],
                prefix_len, parents, positions, inv_freq, c.heads, c.kv_heads, c.rms_eps)

    def head_rows(self, lm_head: Tensor) -> Tensor:
        """The rows of the target's ``lm_head [V, H]`` this draft scores: ``[K, H]`` (all V without a token
        map); an ``eagle3`` draft's own head."""
        if self.eagle3:
            return self.lm_head.weight
        if self.token_map is None:
            return lm_head
        return lm_head.index_select(0, self.token_map.to(lm_head.device))

    def logits(self, out_features: Tensor) -> Tensor:
        """Target lm_head over the specialist output (no norm in between): ``[..., K]`` over the draft
        vocabulary (``K = V`` without a token map; map indices back with :meth:`full_ids`). An ``eagle3``
        draft: its own ``lm_head(norm(out))``."""
        self.target  # noqa: B018  (raises when not attached)
        training = torch.is_grad_enabled() and (out_features.requires_grad or self.eagle3)
        if self.eagle3:
            head = self.lm_head.weight.to(out_features.dtype)
            if training:
                out_features = rms_norm(out_features, self.norm, self.config.rms_eps)
            else:
                out_features = poss_ext.ops.rms_norm(out_features.contiguous(), self.norm.to(out_features.dtype),
                                                     self.config.rms_eps)
        else:
            if (self._head_blocks is not None and not training and out_features.device.type == "cpu"
                    and out_features.dtype in (torch.float32, torch.bfloat16)):
                return project(out_features, self._head_blocks)  # the target's quantized rows (attach_tensors)
            head = self._head.to(out_features.dtype)
        if training:
            return out_features @ head.t()  # training: poss::linear has no backward
        return poss_ext.ops.linear(out_features, head)

    def full_ids(self, index: Tensor) -> Tensor:
        """Full-vocabulary token ids of draft-vocabulary indices (identity without a token map)."""
        return index if self.token_map is None else self.token_map[index]

    def log_probs(self, out_features: Tensor) -> Tensor:
        """``log_softmax`` of :meth:`logits`: ``[..., K] float32`` over the draft vocabulary, what the draft
        tree scores with.
        """
        return torch.log_softmax(self.logits(out_features).float(), dim=-1)

    # -- persistence -----------------------------------------------------------------------------
    def save(self, directory) -> None:
        """Write ``config.json`` and ``model.safetensors`` into ``directory`` (other files there are kept).

        Each is written under a temporary name and renamed, so a kill mid-save (training rewrites
        ``OUT/best`` at every better epoch) never leaves a truncated file in place."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        cfg, weights = d / f"config.json.{os.getpid()}.tmp", d / f"model.safetensors.{os.getpid()}.tmp"
        try:
            self.config.save(cfg)
            save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(weights))
            os.replace(weights, d / "model.safetensors")
            os.replace(cfg, d / "config.json")
        finally:
            cfg.unlink(missing_ok=True)
            weights.unlink(missing_ok=True)

    @classmethod
    def load(cls, directory, dtype: torch.dtype = torch.float32, device="cpu", vocab: str = "trained") -> "PosSDraft":
        """The draft saved in ``directory``. ``vocab``: which rows of the target's lm_head it scores:
        ``"trained"``, its own (the K of a reduced-vocabulary draft, else all), or ``"full"``, all of
        them, for a reduced-vocabulary draft too. The head is the target's, frozen in training, and the
        specialists are trained to reproduce the target's features, so the rows outside the K score
        those features as the target would: the same weights propose tokens the K leaves out, at the
        cost of a head V/K times larger (PosS-2, K 8,192: 3-4 % more tokens per round on MT-Bench,
        docs/training.md).

        A folder in a published layout (EAGLE-1/2, HASS, the PosS reference; docs/interop.md) is
        converted as it loads (:func:`poss.models.draft_interop.load_foreign`)."""
        if vocab not in DRAFT_VOCABS:
            raise ValueError(f"vocab must be one of {', '.join(DRAFT_VOCABS)}, got {vocab!r}")
        d = Path(directory)
        if layout_of(d) != "poss":
            return load_foreign(d, dtype=dtype, device=device, vocab=vocab)
        config = DraftConfig.load(d / "config.json")
        state = load_file(str(d / "model.safetensors"))
        if vocab == "full" and config.features == "eagle3":
            raise ValueError(f"{d} is an EAGLE-3 draft: it scores with its own head of "
                             f"{config.draft_vocab or config.vocab} rows, so vocab 'full' does not apply")
        if vocab == "full" and config.draft_vocab:
            config = replace(config, draft_vocab=0)
            state.pop("token_map", None)
        model = cls(config)
        model.load_state_dict(state, strict=True)
        return model.to(dtype=dtype, device=device).eval()

    @classmethod
    def from_single_layer(cls, state_dict: Dict[str, Tensor], config: DraftConfig) -> "PosSDraft":
        """Every specialist initialised from one layer (as the PosS paper does from a trained EAGLE draft).

        ``state_dict`` holds this class's names for one draft layer: ``fc.*``, ``layers.0.*`` and, for a
        reduced draft vocabulary, ``token_map``; the layer is copied into all ``config.n_specialists`` specialists.
        """
        return cls.from_layers([state_dict] * config.n_specialists, config)

    @classmethod
    def from_layers(cls, state_dicts: List[Dict[str, Tensor]], config: DraftConfig) -> "PosSDraft":
        """Specialist j initialised from single-layer draft ``state_dicts[j]`` (e.g. position 1's from a
        trained EAGLE-2 draft, the deeper ones from HASS's). Each entry holds ``fc.*``, ``layers.0.*`` and,
        for a reduced vocabulary, ``token_map`` (the same in every entry). With ``fc_per_specialist`` each
        specialist takes its source's ``fc``, else the shared ``fc`` is the first source's."""
        if len(state_dicts) != config.n_specialists:
            raise ValueError(f"{len(state_dicts)} source layers for {config.n_specialists} specialists")
        maps = [sd.get("token_map") for sd in state_dicts]
        if any((m is None) != (maps[0] is None) or (m is not None and not torch.equal(m, maps[0])) for m in maps):
            raise ValueError("the source drafts score different vocabularies (their token_map differ)")
        sd = {} if maps[0] is None else {"token_map": maps[0]}
        # An EAGLE-3 draft's own final norm and head: the first source's.
        sd.update({k: state_dicts[0][k] for k in ("norm", "lm_head.weight") if k in state_dicts[0]})
        for j, src in enumerate(state_dicts):
            fc = {k[len("fc."):]: v for k, v in src.items() if k.startswith("fc.")}
            if config.fc_per_specialist:
                sd.update({f"fcs.{j}.{k}": v.clone() for k, v in fc.items()})
            elif j == 0:
                sd.update({f"fc.{k}": v for k, v in fc.items()})
            sd.update({f"layers.{j}.{k[len('layers.0.'):]}": v.clone() for k, v in src.items()
                       if k.startswith("layers.0.")})
        model = cls(config)
        model.load_state_dict(sd, strict=True)
        return model

    @classmethod
    def from_eagle(cls, state_dict: Dict[str, Tensor], config: DraftConfig) -> "PosSDraft":
        """:meth:`from_single_layer` from a checkpoint in EAGLE's names.

        ``state_dict`` uses ``fc.*``, ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
        ``layers.0.post_attention_layernorm.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``;
        its ``embed_tokens`` is ignored (the target's is shared).
        """
        p = "layers.0."
        try:
            sd = {"fc.weight": state_dict["fc.weight"]}
            if config.fc_bias:
                sd["fc.bias"] = state_dict["fc.bias"]
            sd.update({
                p + "qkv_proj.weight": torch.cat([state_dict[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
                p + "o_proj.weight": state_dict[p + "self_attn.o_proj.weight"],
                p + "post_norm": state_dict[p + "post_attention_layernorm.weight"],
                p + "gate_up_proj.weight": torch.cat([state_dict[p + "mlp.gate_proj.weight"],
                                                      state_dict[p + "mlp.up_proj.weight"]]),
                p + "down_proj.weight": state_dict[p + "mlp.down_proj.weight"],
            })
        except KeyError as e:
            raise ValueError(f"not a single-layer EAGLE checkpoint: missing {e}") from None
        return cls.from_single_layer(sd, config)
