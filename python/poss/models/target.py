"""The target runner: our own forward of an HF Llama / Qwen2 / Mistral model on the poss ops.

Every layer is one ``poss::decoder_layer`` call (fused RMSNorm, QKV + RoPE + KV write, tree
attention, SwiGLU) over a preallocated :class:`StaticKVCache`. A prefill is a chain tree. The
runner returns logits and the final-norm hidden states ("features") the draft consumes; with
``feature_layers`` (EAGLE-3 drafts) the features also carry those layers' hidden states, taken in
the same pass.
"""

import hashlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

import poss_ext
from poss.huge_pages import pack_on_huge_pages
from poss.models.kv_cache import StaticKVCache
from poss.models.quant_weight import QuantWeight, Weight, decoder_layer, project
from poss.models.tree import chain_parents

SUPPORTED_MODEL_TYPES = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}


def eagle3_feature_layers(num_layers: int) -> Tuple[int, int, int]:
    """EAGLE-3's low / middle / high target layers for a target of ``num_layers`` decoder layers.

    Indices count as ``transformers``' ``hidden_states`` do: ``i`` is the input of decoder layer ``i``
    (the output of layer ``i - 1``; 0 the embeddings, ``num_layers`` the final-norm output, as
    ``transformers`` returns it). EAGLE-3, SGLang and vLLM take the inputs of layers 2,
    ``num_layers // 2`` and ``num_layers - 3``.
    """
    if num_layers < 3:
        raise ValueError(f"EAGLE-3's default feature layers (2, L // 2, L - 3) need a target of at least 3 "
                         f"layers, this one has {num_layers}: give the feature layers explicitly")
    return (2, num_layers // 2, num_layers - 3)


def check_feature_layers(layers: Sequence[int], num_layers: int) -> Tuple[int, ...]:
    """``layers`` as a tuple of ints in ``[0, num_layers]``, or ``ValueError`` naming the bad one."""
    out = tuple(layers)
    if not out:
        raise ValueError("feature_layers must name at least one layer")
    for i in out:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i <= num_layers:
            raise ValueError(f"feature_layers: {i!r} is not a hidden-state index in [0, {num_layers}] "
                             f"(this target has {num_layers} layers)")
    return out


def check_architecture(config) -> None:
    """Raise a clear error unless the HF ``config`` is an architecture this runner implements."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        names = ", ".join(SUPPORTED_MODEL_TYPES.values())
        raise ValueError(
            f"unsupported architecture {model_type!r} ({getattr(config, 'architectures', None)}); "
            f"poss supports {names}"
        )


def sliding_window(config) -> Optional[int]:
    """The model's attention window in tokens, or None when it attends to the whole context."""
    window = getattr(config, "sliding_window", None)
    return window if window is not None and getattr(config, "use_sliding_window", True) else None


def weight_fingerprint(named_tensors) -> str:
    """A short hash of a model's weights: names, shapes and a strided sample of each tensor.

    Samples are rounded to bf16 first, so the same target loaded in fp32 or bf16 matches (fp16 does
    not: its own rounding moves some weights across a bf16 rounding boundary; see
    :func:`model_fingerprint`). ``named_tensors`` may be a generator: each tensor is dropped once sampled.
    """
    def sampled(name, t):
        flat = t.detach().reshape(-1)
        return name, tuple(t.shape), flat[:: max(1, flat.numel() // 4096)].to("cpu", torch.bfloat16).view(torch.int16)

    h = hashlib.sha256()
    for name, shape, sample in sorted((sampled(n, t) for n, t in named_tensors), key=lambda s: s[0]):
        h.update(f"{name}:{shape}".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def runner_weights(layers, embed: Tensor, lm_head: Tensor, final_norm_w: Tensor):
    """``(name, tensor)`` of every weight in the runner's fused layout: what the fingerprint hashes.
    ``layers`` may be a generator of :class:`LayerParams`."""
    yield from (("embed", embed), ("lm_head", lm_head), ("norm", final_norm_w))
    for i, p in enumerate(layers):
        yield from ((f"{i}.{k}", v) for k, v in vars(p).items() if v is not None)


def model_fingerprint(hf_model) -> str:
    """:meth:`TargetRunner.fingerprint` of ``hf_model`` in its own dtype, one fused layer at a time."""
    m, dtype = hf_model.model, next(hf_model.parameters()).dtype
    return weight_fingerprint(runner_weights((layer_params(l, dtype) for l in m.layers), m.embed_tokens.weight,
                                             hf_model.lm_head.weight, m.norm.weight))


@dataclass
class LayerParams:
    in_norm_w: Tensor
    w_qkv: Weight  # a float tensor, or GGUF blocks (QuantWeight) for a target loaded with dtype "gguf"
    b_qkv: Optional[Tensor]
    w_o: Weight
    post_norm_w: Tensor
    w_gate_up: Weight
    w_down: Weight


def layer_params(layer, dtype, quantized: Optional[Dict[str, QuantWeight]] = None, prefix: str = "") -> LayerParams:
    """Pack one HF decoder layer's weights into the fused layout (q|k|v rows, gate|up rows).

    ``quantized``: HF parameter name (``prefix`` + ``self_attn.q_proj.weight``...) -> GGUF blocks; a fused
    weight whose parts are all blocks of one format stays blocks, any other is the HF model's, in ``dtype``.
    """
    att = layer.self_attn
    cvt = lambda t: t.detach().to(dtype).contiguous()  # noqa: E731
    has_bias = att.q_proj.bias is not None

    def weight(*names):
        blocks = QuantWeight.stack([(quantized or {}).get(f"{prefix}{n}.weight") for n in names])
        if blocks is not None:
            return blocks.interleaved()
        modules = [layer.get_submodule(n) for n in names]
        return cvt(torch.cat([m.weight for m in modules]) if len(modules) > 1 else modules[0].weight)

    return LayerParams(
        in_norm_w=cvt(layer.input_layernorm.weight),
        w_qkv=weight("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        b_qkv=cvt(torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])) if has_bias else None,
        w_o=weight("self_attn.o_proj"),
        post_norm_w=cvt(layer.post_attention_layernorm.weight),
        w_gate_up=weight("mlp.gate_proj", "mlp.up_proj"),
        w_down=weight("mlp.down_proj"),
    )


class TargetRunner:
    """Static-cache forward of an HF causal LM; see the module docstring.

    Args:
        hf_model: a loaded ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM``.
        max_batch, max_seq: cache capacity (requests, tokens per request incl. the draft tree).
        dtype: compute dtype (float32 / bfloat16 / float16); defaults to the model's.
        huge_pages: on a CPU, copy the weights onto 2 MB pages (:mod:`poss.huge_pages`; a
            no-op where the OS cannot): a decode step streams them all, and 4 KB pages cost TLB misses.
        quantized: HF parameter name -> GGUF blocks (:func:`poss.models.gguf_weights.read_gguf_linears`):
            those projections (and ``lm_head.weight``'s logits) run :func:`poss_ext.ops.qlinear` on the
            blocks, CPU only; ``hf_model`` holds the same weights dequantised, for everything else. A
            draft's head runs the rows it scores of :attr:`lm_head_blocks` (:meth:`PosSDraft.attach_tensors`).
            Blocks of the wrong shape for their weight, or with an inf / NaN scale, are a ``ValueError``
            naming the weight.
        feature_layers: hidden-state indices (:func:`eagle3_feature_layers`) whose hidden states the
            features carry beside the final-norm ones (:meth:`set_feature_layers`); None: the final-norm
            ones only.
    """

    def __init__(self, hf_model, max_batch: int, max_seq: int, dtype: Optional[torch.dtype] = None,
                 huge_pages: bool = True, quantized: Optional[Dict[str, QuantWeight]] = None,
                 feature_layers: Optional[Sequence[int]] = None):
        cfg = hf_model.config
        check_architecture(cfg)
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"only SiLU-gated MLPs are supported, got hidden_act={cfg.hidden_act!r}")
        if max_batch < 1 or max_seq < 1:
            raise ValueError(f"max_batch and max_seq must be >= 1, got {max_batch} and {max_seq}")
        window = sliding_window(cfg)
        if window is not None and max_seq > window:
            raise ValueError(f"max_seq={max_seq} exceeds the model's sliding window {window}, "
                             "which this runner does not implement")
        rotary = hf_model.model.rotary_emb
        if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
            raise ValueError("RoPE variants with attention scaling (e.g. YaRN) are not supported")
        self.config = cfg
        self.dtype = dtype or next(hf_model.parameters()).dtype
        self.device = next(hf_model.parameters()).device
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.eps = float(cfg.rms_norm_eps)
        # HF's own inverse frequencies, so every RoPE scaling it implements is folded in here.
        self.inv_freq = rotary.inv_freq.detach().float().to(self.device).contiguous()
        if quantized and self.device.type != "cpu":
            raise ValueError(f"quantized (GGUF block) weights run on the CPU only, the model is on {self.device}")
        quantized = quantized or {}
        for name, q in quantized.items():
            # At load, naming the weight: a forward would only meet a bad scale in poss::qlinear.
            try:
                want = hf_model.get_parameter(name)
            except AttributeError:
                raise ValueError(f"quantized: {name!r} is not a weight of this model") from None
            q.check(f"quantized[{name!r}]", tuple(want.shape))
        self.layers: List[LayerParams] = [layer_params(l, self.dtype, quantized, f"model.layers.{i}.")
                                          for i, l in enumerate(hf_model.model.layers)]
        self.embed = hf_model.model.embed_tokens.weight.detach().to(self.dtype)
        self.final_norm_w = hf_model.model.norm.weight.detach().to(self.dtype).contiguous()
        self.lm_head = hf_model.lm_head.weight.detach().to(self.dtype)
        # The logits' lm_head as blocks (the float one above stays: the embedding of a tied head, training).
        head_blocks = quantized.get("lm_head.weight")
        self.lm_head_blocks: Optional[QuantWeight] = None if head_blocks is None else head_blocks.interleaved()
        self.quantized = self.lm_head_blocks is not None or any(
            isinstance(w, QuantWeight) for p in self.layers for w in vars(p).values())
        if huge_pages and self.device.type == "cpu":
            self._move_weights_to_huge_pages()
        self._fingerprint: Optional[str] = None
        if self.quantized:
            # The dequantised weights' (hf_model's): a draft trained on the file's float target attaches.
            self._fingerprint = model_fingerprint(hf_model)
        elif self.dtype == torch.float16 and next(hf_model.parameters()).dtype != torch.float16:
            # Taken before fp16's rounding, so a draft trained on the fp32 / bf16 target attaches.
            self._fingerprint = model_fingerprint(hf_model)
        self.cache = StaticKVCache.zeros(len(self.layers), max_batch, self.num_kv_heads, max_seq,
                                         self.head_dim, self.dtype, self.device)
        self.feature_layers: Optional[Tuple[int, ...]] = None
        self.set_feature_layers(feature_layers)

    def set_feature_layers(self, layers: Optional[Sequence[int]]) -> "TargetRunner":
        """Make :meth:`forward` return, after the final-norm features, the hidden states of ``layers``
        (hidden-state indices, :func:`eagle3_feature_layers`) concatenated in that order: features
        ``[..., (1 + n) * H]``. None: the final-norm features only (the default, nothing extra computed)."""
        self.feature_layers = None if layers is None else check_feature_layers(layers, len(self.layers))
        return self

    @property
    def feature_width(self) -> int:
        """The width of :meth:`forward`'s features: H, or ``(1 + len(feature_layers)) * H``."""
        return self.hidden_size * (1 + len(self.feature_layers or ()))

    def _move_weights_to_huge_pages(self) -> None:
        fields = [(p, k) for p in self.layers for k in vars(p)]
        tensors = [getattr(p, k) for p, k in fields]
        tensors = [w.blocks if isinstance(w, QuantWeight) else w for w in tensors]
        head_blocks = [] if self.lm_head_blocks is None else [self.lm_head_blocks.blocks]
        packed = pack_on_huge_pages(tensors + [self.embed, self.lm_head, self.final_norm_w] + head_blocks)
        for (p, k), t in zip(fields, packed):
            w = getattr(p, k)
            setattr(p, k, QuantWeight(t, w.format) if isinstance(w, QuantWeight) else t)
        self.embed, self.lm_head, self.final_norm_w = packed[len(fields):len(fields) + 3]
        if head_blocks:
            self.lm_head_blocks = QuantWeight(packed[-1], self.lm_head_blocks.format)

    @property
    def hidden_size(self) -> int:
        return self.embed.shape[1]

    def weights(self) -> List[Tensor]:
        """Every tensor the forward reads besides its inputs and the cache: the layers' weights, the
        embedding, the final norm, the lm_head and the RoPE frequencies."""
        layers = [v.blocks if isinstance(v, QuantWeight) else v for p in self.layers for v in vars(p).values()
                  if v is not None]
        head = [] if self.lm_head_blocks is None else [self.lm_head_blocks.blocks]
        return layers + [self.embed, self.final_norm_w, self.lm_head, self.inv_freq] + head

    def weight_formats(self) -> Dict[str, int]:
        """How many of the linear weights the forward streams (the fused layers' and the logits'
        lm_head) are in each format: ``"q4_1"``..., or the float dtype's name."""
        counts: Dict[str, int] = {}
        head = self.lm_head_blocks if self.lm_head_blocks is not None else self.lm_head
        for w in [getattr(p, k) for p in self.layers for k in ("w_qkv", "w_o", "w_gate_up", "w_down")] + [head]:
            name = w.file_format if isinstance(w, QuantWeight) else str(w.dtype).replace("torch.", "")
            counts[name] = counts.get(name, 0) + 1
        return counts

    def fingerprint(self) -> str:
        """Hash of the target's weights; a draft records it and refuses any other target."""
        if self._fingerprint is None:
            self._fingerprint = weight_fingerprint(runner_weights(self.layers, self.embed, self.lm_head,
                                                                  self.final_norm_w))
        return self._fingerprint

    @torch.no_grad()
    def forward(self, tokens: Tensor, positions: Tensor, parents: Tensor, prefix_len: Tensor,
                check_capacity: bool = True, logits: bool = True) -> Tuple[Optional[Tensor], Tensor]:
        """Run T new tokens, the last T nodes of the tree ``parents``, behind the committed prefix.

        Args:
            tokens: ``[B, T] int64``; positions: ``[B, T] int64`` (prefix_len + depth of the node).
            parents: ``[B, N] int32`` tree, N >= T; node i's K/V go to slot ``prefix_len + i``.
            prefix_len: ``[B] int32`` committed cache length per request (B <= max_batch).
            check_capacity: raise a clear error when the tree does not fit the cache. The check reads
                ``prefix_len`` back to the host (a device sync); the decoding loop, which knows every
                length on the host, checks once per call itself and passes False.
            logits: also apply the lm_head (training only needs the features).
        Returns:
            logits ``[B, T, V]`` (None when ``logits=False``) and features ``[B, T, H]`` (hidden
            states after the final norm), in the runner's dtype; with :attr:`feature_layers`,
            ``[B, T, (1 + n) * H]``: the final-norm states, then the hidden states at index
            ``feature_layers[i]`` (:func:`eagle3_feature_layers`), taken in this pass. Only the cache is written.
        """
        B = tokens.shape[0]
        if check_capacity:
            if B > self.cache.batch:
                raise ValueError(f"batch {B} exceeds the cache's max_batch={self.cache.batch}")
            self.cache.check_fits(prefix_len, parents.shape[1])
        x = torch.nn.functional.embedding(tokens, self.embed)
        taps = {}
        for i, p in enumerate(self.layers):
            if self.feature_layers is not None and i in self.feature_layers:
                taps[i] = x  # hidden_states[i]: the input of layer i (layers return new tensors)
            k, v = self.cache.layer(i)
            # GGUF blocks: the same ops, each projection through qlinear where it has blocks.
            layer = decoder_layer if self.quantized else poss_ext.ops.decoder_layer
            args = (p,) if self.quantized else (p.in_norm_w, p.w_qkv, p.b_qkv, p.w_o, p.post_norm_w, p.w_gate_up,
                                                p.w_down)
            x = layer(x, *args, k[:B], v[:B], prefix_len, parents, positions, self.inv_freq,
                      self.num_heads, self.num_kv_heads, self.eps)
        features = poss_ext.ops.rms_norm(x, self.final_norm_w, self.eps)
        out_logits = self.logits(features) if logits else None
        if self.feature_layers is not None:
            taps[len(self.layers)] = features  # as transformers' last hidden state: after the final norm
            features = torch.cat([features] + [taps[i] for i in self.feature_layers], -1)
        return out_logits, features

    __call__ = forward

    def logits(self, features: Tensor) -> Tensor:
        """The lm_head: ``[..., H]`` features (or :meth:`forward`'s wider ones: their first H columns)
        -> ``[..., V]`` logits in the runner's dtype."""
        H = self.hidden_size
        if features.shape[-1] != H:
            features = features[..., :H].contiguous()
        return project(features, self.lm_head if self.lm_head_blocks is None else self.lm_head_blocks)

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]]) -> Tuple[Tensor, Tensor]:
        """Process ragged prompts into an empty cache (prompt b's committed length is then ``len(prompts[b])``).

        Returns:
            last_logits ``[B, V]`` at each prompt's last token, and features ``[B, L_max, H]``
            (``[B, L_max, feature_width]`` with :attr:`feature_layers`; rows past a prompt's length are
            padding).
        """
        B = len(prompts)
        if B > self.cache.batch:
            raise ValueError(f"batch {B} exceeds the cache's max_batch={self.cache.batch}")
        lengths = [len(p) for p in prompts]
        if min(lengths) < 1:
            raise ValueError("every prompt needs at least one token")
        L = max(lengths)
        if L > self.cache.max_seq:
            raise ValueError(f"prompt of {L} tokens is longer than the cache (max_seq={self.cache.max_seq})")
        tokens = torch.zeros(B, L, dtype=torch.int64)
        for b, p in enumerate(prompts):
            tokens[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.int64)
        tokens = tokens.to(self.device)
        positions = torch.arange(L, device=self.device).expand(B, L).contiguous()
        parents = chain_parents(lengths, L, self.device)
        prefix = torch.zeros(B, dtype=torch.int32, device=self.device)
        _, features = self.forward(tokens, positions, parents, prefix, check_capacity=False, logits=False)
        last = torch.tensor([n - 1 for n in lengths], device=self.device)
        last_logits = self.logits(features[torch.arange(B, device=self.device), last])
        return last_logits, features
