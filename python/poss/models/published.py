"""The draft layouts other projects publish, and their conversion to and from poss's own.

Layouts (names, shapes and config fields as the reference code defines them; docs/interop.md):

- ``eagle``: EAGLE-1 / EAGLE-2 (SafeAILab/EAGLE ``cnets.py``) and HASS, which uses the same files:
  one decoder layer ``layers.0.*`` without input norm (``self_attn.{q,k,v,o}_proj.weight``,
  ``post_attention_layernorm.weight``, ``mlp.{gate,up,down}_proj.weight``), ``fc.weight [H, 2H]`` over
  ``[embedding; feature]`` with ``fc.bias`` unless the config says ``"bias": false``, an optional
  ``embed_tokens.weight`` (the target's), and an HF Llama ``config.json``. The head is the target's.
- ``poss-ref``: the PosS authors' code (``cnets_poss_layer*.py``): the same names over N layers
  ``layers.{0..N-1}.*``, one shared ``fc``, ``embed_tokens.weight`` required (it loads strictly); layer
  ``min((p - 1) // position_per_layer, N - 1)`` drafts position p, where ``N = forward_num_total //
  position_per_layer`` (command-line flags there; written into config.json here).
- ``eagle3``: EAGLE-3 (``cnets.py`` ``Model``; SGLang ``LlamaForCausalLMEagle3``, vLLM
  ``Eagle3LlamaForCausalLM``): ``midlayer.*`` (``layers.0.*`` in vLLM's speculators files) with
  ``input_layernorm`` / ``hidden_norm`` / ``post_attention_layernorm``, q/k/v over ``2H``,
  ``fc.weight [H, 3*Ht]`` without bias, ``norm.weight``, ``lm_head.weight [K, H]``, ``d2t [K] int64``
  and ``t2d [V] bool``; config adds ``draft_vocab_size`` (and ``target_hidden_size``).

poss's own layout (:class:`~poss.models.draft.PosSDraft`) packs q|k|v and gate|up rows and calls the
post-attention norm ``post_norm``; converting is concatenating or splitting rows, so every weight keeps
its bits and dtype. A reduced draft vocabulary has no place in the ``eagle`` / ``poss-ref`` files: it
travels as ``hot_token_ids.pt`` (the file SGLang's ``--speculative-token-map`` reads).
"""

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from poss.models.checkpoint_files import read_names, read_weights
from poss.models.draft_config import DraftConfig
from poss.models.eagle3_draft import (
    Eagle3Config,
    Eagle3Draft,
    d2t_t2d,
    is_eagle3_folder,
    token_map_from_d2t,
)

LAYOUTS = ("eagle", "poss-ref", "eagle3")
LAYOUT_NAMES = {"eagle": "EAGLE-1 / EAGLE-2 / HASS", "poss-ref": "PosS reference", "eagle3": "EAGLE-3",
                "poss": "poss", "poss-eagle3": "poss (EAGLE-3 weights)"}
TOKEN_MAP_FILE = "hot_token_ids.pt"
POSS_KEY = "poss"  # config.json key holding the poss DraftConfig of an exported draft

_LAYER = re.compile(r"^layers\.(\d+)\.")
_ATTN = ("q", "k", "v", "o")
_MLP = ("gate", "up", "down")
# Tensors a published file may carry that poss does not use: the target's embedding (compared with the
# target's on import) and RoPE buffers that older code saved.
_IGNORED = re.compile(r"^(embed_tokens\.weight|.*rotary_emb\.inv_freq)$")


@dataclass
class Converted:
    """A published checkpoint in poss's names: ``config`` is a :class:`DraftConfig` (``eagle``,
    ``poss-ref``) or an :class:`Eagle3Config` (``eagle3``); ``state`` holds the tensors in their stored
    dtypes; ``embed`` the checkpoint's ``embed_tokens.weight [V, H]`` when it has one."""

    layout: str
    config: Union[DraftConfig, Eagle3Config]
    state: Dict[str, Tensor]
    embed: Optional[Tensor] = None
    files: List[Path] = field(default_factory=list)
    file_format: str = ""
    ignored: List[str] = field(default_factory=list)


def _config_json(folder: Path) -> Optional[dict]:
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def layout_of(folder) -> str:
    """``"poss"``, ``"poss-eagle3"`` (:mod:`poss.models.eagle3_draft`) or one of :data:`LAYOUTS`.

    A folder whose config.json is missing, malformed or not an HF config counts as ``"poss"``, so
    :meth:`DraftConfig.load` reports what is wrong with it.
    """
    d = Path(folder)
    cfg = _config_json(d)
    if is_eagle3_folder(cfg):
        return "poss-eagle3"
    if cfg is None or "hidden" in cfg or "hidden_size" not in cfg:
        return "poss"
    names = read_names(d)
    archs = " ".join(cfg.get("architectures") or [])
    if (any(n.startswith("midlayer.") for n in names) or "layers.0.hidden_norm.weight" in names
            or "Eagle3" in archs or cfg.get("draft_vocab_size") is not None):
        return "eagle3"
    n_layers = len({int(m.group(1)) for n in names if (m := _LAYER.match(n))})
    return "poss-ref" if n_layers > 1 or "position_per_layer" in cfg else "eagle"


def _missing_error(folder: Path, layout: str, missing: List[str]) -> ValueError:
    shown = ", ".join(missing[:12]) + (f" and {len(missing) - 12} more" if len(missing) > 12 else "")
    return ValueError(f"{folder}: not a complete {LAYOUT_NAMES[layout]} checkpoint: missing {shown}")


def _rope(cfg: dict) -> Dict:
    rope = {"rope_theta": float(cfg.get("rope_theta", 10000.0)), "rope_type": "default"}
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict):
        rope.update(scaling)
        rope["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
        rope.pop("type", None)
    return rope


def _shape_fields(cfg: dict, folder: Path) -> dict:
    try:
        H, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        return dict(hidden=H, heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
                    head_dim=int(cfg.get("head_dim") or H // heads), ffn=int(cfg["intermediate_size"]),
                    vocab=int(cfg["vocab_size"]), rms_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope=_rope(cfg))
    except KeyError as e:
        raise ValueError(f"{folder / 'config.json'}: missing keys [{e.args[0]!r}]") from None


def _check_supported(cfg: dict, folder: Path) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{folder}: hidden_act {cfg['hidden_act']!r}; poss drafts use SiLU-gated MLPs")
    if cfg.get("qkv_bias") or cfg.get("attention_bias"):
        raise ValueError(f"{folder}: q/k/v biases (qkv_bias / attention_bias in config.json), which poss drafts lack")


def _check_shapes(folder: Path, state: Dict[str, Tensor], want: Dict[str, tuple]) -> None:
    for name, shape in want.items():
        got = tuple(state[name].shape)
        if got != shape:
            raise ValueError(f"{folder}: {name} (poss name) has shape {got}, but config.json implies {shape}")


def _read_token_map(folder: Path, vocab: int) -> Optional[Tensor]:
    path = folder / TOKEN_MAP_FILE
    if not path.is_file():
        return None
    ids = torch.load(str(path), map_location="cpu", weights_only=True)
    ids = torch.as_tensor(ids).to(torch.int64)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"{path}: expected a 1-D list of token ids, got shape {tuple(ids.shape)}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != ids.numel():
        raise ValueError(f"{path}: token ids must be distinct and in [0, vocab_size={vocab})")
    return ids


def _poss_block(cfg: dict, config: DraftConfig, folder: Path) -> DraftConfig:
    """``config`` with the non-shape fields of an export's ``poss`` block (positions, target, training)."""
    block = cfg.get(POSS_KEY)
    if not isinstance(block, dict):
        return config
    for name in ("hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "n_specialists", "fc_bias"):
        if name in block and block[name] != getattr(config, name):
            raise ValueError(f"{folder / 'config.json'}: poss.{name} = {block[name]!r} contradicts the "
                             f"published fields ({getattr(config, name)!r})")
    kept = {k: block[k] for k in ("positions_per_specialist", "target_name", "target_fingerprint", "training")
            if k in block}
    rope = block.get("rope")
    if isinstance(rope, dict) and rope.get("rope_theta") == config.rope.get("rope_theta"):
        kept["rope"] = rope
    data = {**asdict(config), **kept}
    return DraftConfig(**data)


def read_eagle(folder, layout: str, positions_per_specialist: Optional[int] = None) -> Converted:
    """An ``eagle`` or ``poss-ref`` folder in poss's names (see the module docstring).

    ``positions_per_specialist`` overrides the config's ``position_per_layer``; a several-layer
    checkpoint needs one or the other. ``ValueError`` naming what is missing, unexpected or misshapen.
    """
    d = Path(folder)
    cfg = _config_json(d) or {}
    _check_supported(cfg, d)
    state, fmt, files = read_weights(d)
    layers = sorted({int(m.group(1)) for n in state if (m := _LAYER.match(n))})
    n = len(layers) or 1
    if layers and layers != list(range(n)):
        raise ValueError(f"{d}: decoder layers {layers} are not numbered 0..{n - 1}")
    stacked = [f"layers.{j}.input_layernorm.weight" for j in range(n) if f"layers.{j}.input_layernorm.weight" in state]
    if stacked:
        raise ValueError(f"{d}: {stacked[0]} is an input norm, which a stacked multi-layer EAGLE draft has and "
                         "poss's specialists (like the PosS reference's) do not")
    fc_bias = bool(cfg.get("bias", True))  # the reference reads "bias" and defaults to True
    want = ["fc.weight"] + ["fc.bias"] * fc_bias + [
        f"layers.{j}.{n_}" for j in range(n) for n_ in
        [f"self_attn.{p}_proj.weight" for p in _ATTN] + ["post_attention_layernorm.weight"]
        + [f"mlp.{p}_proj.weight" for p in _MLP]]
    missing = [k for k in want if k not in state]
    if missing:
        raise _missing_error(d, layout, missing)
    ignored = sorted(k for k in state if _IGNORED.match(k))
    extra = sorted(set(state) - set(want) - set(ignored))
    if extra:
        raise ValueError(f"{d}: tensors the {LAYOUT_NAMES[layout]} layout does not have: {', '.join(extra[:12])}")
    pps = positions_per_specialist or cfg.get("position_per_layer") or (cfg.get(POSS_KEY) or {}).get(
        "positions_per_specialist")
    if pps is None:
        if n > 1:
            raise ValueError(f"{d}: {n} specialist layers, but config.json has no position_per_layer; pass "
                             "positions_per_specialist (the reference's --position_per_layer), e.g. "
                             "`poss import ... --positions-per-specialist 2`")
        pps = 1
    vocab = int(cfg.get("vocab_size", 0))
    token_map = _read_token_map(d, vocab) if vocab else None
    config = DraftConfig(**_shape_fields(cfg, d), n_specialists=n, positions_per_specialist=int(pps),
                         fc_bias=fc_bias, draft_vocab=0 if token_map is None else token_map.numel())
    config = _poss_block(cfg, config, d)
    if positions_per_specialist:
        config.positions_per_specialist = int(positions_per_specialist)
    ours = {"fc.weight": state["fc.weight"]}
    if fc_bias:
        ours["fc.bias"] = state["fc.bias"]
    for j in range(n):
        p = f"layers.{j}."
        ours[p + "qkv_proj.weight"] = torch.cat([state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        ours[p + "o_proj.weight"] = state[p + "self_attn.o_proj.weight"]
        ours[p + "post_norm"] = state[p + "post_attention_layernorm.weight"]
        ours[p + "gate_up_proj.weight"] = torch.cat([state[p + "mlp.gate_proj.weight"],
                                                     state[p + "mlp.up_proj.weight"]])
        ours[p + "down_proj.weight"] = state[p + "mlp.down_proj.weight"]
    if token_map is not None:
        ours["token_map"] = token_map
    _check_shapes(d, ours, _draft_shapes(config))
    return Converted(layout, config, ours, state.get("embed_tokens.weight"), files, fmt, ignored)


def _draft_shapes(c: DraftConfig) -> Dict[str, tuple]:
    H, q, kv = c.hidden, c.heads * c.head_dim, c.kv_heads * c.head_dim
    s = {"fc.weight": (H, 2 * H)}
    if c.fc_bias:
        s["fc.bias"] = (H,)
    for j in range(c.n_specialists):
        p = f"layers.{j}."
        s.update({p + "qkv_proj.weight": (q + 2 * kv, H), p + "o_proj.weight": (H, q), p + "post_norm": (H,),
                  p + "gate_up_proj.weight": (2 * c.ffn, H), p + "down_proj.weight": (H, c.ffn)})
    if c.draft_vocab:
        s["token_map"] = (c.draft_vocab,)
    return s


def read_eagle3(folder) -> Converted:
    """An ``eagle3`` folder as an :class:`Eagle3Draft`'s config and tensors (see the module docstring)."""
    d = Path(folder)
    cfg = _config_json(d) or {}
    _check_supported(cfg, d)
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{d}: num_hidden_layers = {cfg['num_hidden_layers']}; poss converts single-layer "
                         "EAGLE-3 drafts only")
    state, fmt, files = read_weights(d)
    prefix = "layers.0." if any(k.startswith("layers.0.") for k in state) else "midlayer."
    shape = _shape_fields(cfg, d)
    vocab = shape["vocab"]
    k = int(cfg.get("draft_vocab_size") or vocab)
    fc_bias = bool(cfg.get("bias", False))
    layer = ([f"self_attn.{p}_proj.weight" for p in _ATTN] + [f"mlp.{p}_proj.weight" for p in _MLP]
             + [f"{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")])
    want = ["fc.weight", "norm.weight", "lm_head.weight"] + ["fc.bias"] * fc_bias + [prefix + n for n in layer]
    has_map = k < vocab or "d2t" in state or "t2d" in state
    want += ["d2t", "t2d"] * has_map
    missing = [n for n in want if n not in state]
    if missing:
        raise _missing_error(d, "eagle3", missing)
    ignored = sorted(n for n in state if _IGNORED.match(n))
    extra = sorted(set(state) - set(want) - set(ignored))
    if extra:
        raise ValueError(f"{d}: tensors the EAGLE-3 layout does not have: {', '.join(extra[:12])}")
    ours = {"fc.weight": state["fc.weight"], "norm": state["norm.weight"], "lm_head.weight": state["lm_head.weight"]}
    if fc_bias:
        ours["fc.bias"] = state["fc.bias"]
    p = prefix
    ours.update({
        "layers.0.qkv_proj.weight": torch.cat([state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
        "layers.0.o_proj.weight": state[p + "self_attn.o_proj.weight"],
        "layers.0.input_norm": state[p + "input_layernorm.weight"],
        "layers.0.hidden_norm": state[p + "hidden_norm.weight"],
        "layers.0.post_norm": state[p + "post_attention_layernorm.weight"],
        "layers.0.gate_up_proj.weight": torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]),
        "layers.0.down_proj.weight": state[p + "mlp.down_proj.weight"],
    })
    if has_map:
        d2t, t2d = state["d2t"], state["t2d"]
        if d2t.shape != (k,) or t2d.shape != (vocab,):
            raise ValueError(f"{d}: d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} must be [{k}] / [{vocab}] "
                             "(draft_vocab_size / vocab_size)")
        token_map = token_map_from_d2t(d2t)
        if int(token_map.min()) < 0 or int(token_map.max()) >= vocab:
            raise ValueError(f"{d}: d2t maps draft ids outside the vocabulary [0, {vocab})")
        if not torch.equal(d2t_t2d(token_map, vocab)[1], t2d.to(torch.bool)):
            raise ValueError(f"{d}: t2d does not mark exactly the tokens d2t maps to")
        ours["token_map"] = token_map
    block = cfg.get(POSS_KEY) if isinstance(cfg.get(POSS_KEY), dict) else {}
    config = Eagle3Config(**shape, target_hidden=int(cfg.get("target_hidden_size") or shape["hidden"]),
                          draft_vocab=k if has_map else 0, fc_bias=fc_bias, layer_prefix=prefix,
                          target_name=block.get("target_name", ""),
                          target_fingerprint=block.get("target_fingerprint", ""),
                          source_config={kk: v for kk, v in cfg.items() if kk != POSS_KEY})
    Eagle3Draft(config, ours)  # validates every shape against the config
    return Converted("eagle3", config, ours, state.get("embed_tokens.weight"), files, fmt, ignored)


def read_published(folder, positions_per_specialist: Optional[int] = None) -> Converted:
    """Detect ``folder``'s layout (:func:`layout_of`) and convert it; ``ValueError`` for poss's own folders."""
    layout = layout_of(folder)
    if layout in ("poss", "poss-eagle3"):
        raise ValueError(f"{folder} is already in poss's format")
    return read_eagle3(folder) if layout == "eagle3" else read_eagle(folder, layout, positions_per_specialist)


# -- poss -> published ---------------------------------------------------------------------------
def _llama_config(c, dtype: torch.dtype, max_positions: int) -> dict:
    rope = dict(c.rope)
    theta = rope.pop("rope_theta", 10000.0)
    kind = rope.pop("rope_type", "default")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": c.hidden, "intermediate_size": c.ffn, "num_attention_heads": c.heads,
            "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
            "vocab_size": c.vocab, "rms_norm_eps": c.rms_eps, "rope_theta": theta,
            "rope_scaling": None if kind == "default" else {"rope_type": kind, **rope},
            "max_position_embeddings": max_positions, "tie_word_embeddings": False, "pretraining_tp": 1,
            "initializer_range": 0.02, "use_cache": True, "torch_dtype": str(dtype).replace("torch.", "")}


def to_eagle(config: DraftConfig, state: Dict[str, Tensor], layout: str, embed: Optional[Tensor] = None,
             max_positions: int = 2048) -> Tuple[Dict[str, Tensor], dict, Optional[Tensor]]:
    """A poss draft's ``(config, state)`` in the ``eagle`` or ``poss-ref`` layout:
    ``(tensors, config.json dict, token map or None)``; the token map goes to :data:`TOKEN_MAP_FILE`.

    ``embed [V, H]`` (the target's embedding) is written as ``embed_tokens.weight`` in the draft's
    dtype; ``poss-ref`` requires it (its loader is strict). ``ValueError`` for an ``eagle`` export of
    several specialists.
    """
    if layout not in ("eagle", "poss-ref"):
        raise ValueError(f"layout must be 'eagle' or 'poss-ref', got {layout!r}")
    if layout == "eagle" and config.n_specialists > 1:
        raise ValueError(f"the EAGLE layout holds one layer and this draft has {config.n_specialists} "
                         "specialists: export it as poss-ref")
    if config.fc_per_specialist:
        raise ValueError("this draft gives each specialist its own fc; the EAGLE and PosS reference layouts hold "
                         "one shared fc, so it has no exact form there")
    if config.schedule and config.schedule != [config.positions_per_specialist] * config.n_specialists:
        raise ValueError(f"this draft's specialists draft {config.schedule} positions each; the PosS reference "
                         "gives every specialist the same number, so it has no exact form there")
    if layout == "poss-ref" and embed is None:
        raise ValueError("the PosS reference loads its checkpoint strictly, embed_tokens.weight included: "
                         "give the target (--target) so its embedding can be written")
    dtype = state["fc.weight"].dtype
    out = {"fc.weight": state["fc.weight"]}
    if config.fc_bias:
        out["fc.bias"] = state["fc.bias"]
    q, kv, F = config.heads * config.head_dim, config.kv_heads * config.head_dim, config.ffn
    for j in range(config.n_specialists):
        p = f"layers.{j}."
        wq, wk, wv = state[p + "qkv_proj.weight"].split([q, kv, kv])
        gate, up = state[p + "gate_up_proj.weight"].split([F, F])
        out.update({p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk,
                    p + "self_attn.v_proj.weight": wv, p + "self_attn.o_proj.weight": state[p + "o_proj.weight"],
                    p + "post_attention_layernorm.weight": state[p + "post_norm"],
                    p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                    p + "mlp.down_proj.weight": state[p + "down_proj.weight"]})
    if embed is not None:
        if tuple(embed.shape) != (config.vocab, config.hidden):
            raise ValueError(f"embedding {tuple(embed.shape)} does not match the draft's vocab x hidden "
                             f"({config.vocab}, {config.hidden})")
        out["embed_tokens.weight"] = embed.to(dtype)
    cfg = _llama_config(config, dtype, max_positions)
    cfg["bias"] = config.fc_bias
    if layout == "poss-ref":
        cfg["forward_num_total"] = config.n_specialists * config.positions_per_specialist
        cfg["position_per_layer"] = config.positions_per_specialist
    cfg[POSS_KEY] = asdict(config)
    token_map = state.get("token_map") if config.draft_vocab else None
    return {k: v.contiguous() for k, v in out.items()}, cfg, token_map


def to_eagle3(draft: Eagle3Draft, embed: Optional[Tensor] = None) -> Tuple[Dict[str, Tensor], dict]:
    """An :class:`Eagle3Draft` in the published EAGLE-3 layout: ``(tensors, config.json dict)``; the
    config is the one it was imported with (or one built from its fields) plus poss's target record."""
    c, s = draft.config, draft.state
    p = c.layer_prefix
    q, kv, F = c.heads * c.head_dim, c.kv_heads * c.head_dim, c.ffn
    wq, wk, wv = s["layers.0.qkv_proj.weight"].split([q, kv, kv])
    gate, up = s["layers.0.gate_up_proj.weight"].split([F, F])
    out = {"fc.weight": s["fc.weight"], "norm.weight": s["norm"], "lm_head.weight": s["lm_head.weight"],
           p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk, p + "self_attn.v_proj.weight": wv,
           p + "self_attn.o_proj.weight": s["layers.0.o_proj.weight"],
           p + "input_layernorm.weight": s["layers.0.input_norm"], p + "hidden_norm.weight": s["layers.0.hidden_norm"],
           p + "post_attention_layernorm.weight": s["layers.0.post_norm"],
           p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
           p + "mlp.down_proj.weight": s["layers.0.down_proj.weight"]}
    if c.fc_bias:
        out["fc.bias"] = s["fc.bias"]
    if c.draft_vocab:
        out["d2t"], out["t2d"] = d2t_t2d(s["token_map"], c.vocab)
    if embed is not None:
        if tuple(embed.shape) != (c.vocab, c.hidden):
            raise ValueError(f"embedding {tuple(embed.shape)} does not match the draft's vocab x hidden "
                             f"({c.vocab}, {c.hidden})")
        out["embed_tokens.weight"] = embed.to(s["fc.weight"].dtype)
    cfg = dict(c.source_config) or {**_llama_config(c, s["fc.weight"].dtype, 2048),
                                    "architectures": ["LlamaForCausalLMEagle3"]}
    cfg["draft_vocab_size"] = c.head_rows
    if c.target_hidden != c.hidden:
        cfg["target_hidden_size"] = c.target_hidden
    if c.target_name or c.target_fingerprint:
        cfg[POSS_KEY] = {"target_name": c.target_name, "target_fingerprint": c.target_fingerprint}
    return {k: v.contiguous() for k, v in out.items()}, cfg
