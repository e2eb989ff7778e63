"""An imported EAGLE-3 draft's weights in poss's folder format, as ``poss import`` writes them.

EAGLE-3 (Li et al. 2025) is not the PosS / EAGLE-2 draft with other names: its ``fc`` fuses three target
layers' hidden states (``3 * target_hidden`` inputs, no embedding), the decoder layer normalises the
embedding (``input_layernorm``) and the fused feature (``hidden_norm``) and attends over their
concatenation (q/k/v over ``2 * hidden``), and it scores its own reduced vocabulary with its own
``norm`` and ``lm_head`` (``d2t`` maps draft ids to target ids). This format keeps the published
config for ``poss export --format eagle3`` (bit for bit); :func:`as_draft_config` gives the
:class:`~poss.models.draft_config.DraftConfig` (``features = "eagle3"``) under which
:class:`~poss.models.draft.PosSDraft` runs the same tensors, with the same names.

Stored names (packed as poss packs its specialists): ``fc.weight [H, 3*Ht]`` (``fc.bias [H]`` when the
config has ``bias``), ``layers.0.qkv_proj.weight [(heads + 2*kv_heads) * head_dim, 2*H]``,
``layers.0.o_proj.weight``, ``layers.0.input_norm [H]``, ``layers.0.hidden_norm [H]``,
``layers.0.post_norm [H]``, ``layers.0.gate_up_proj.weight [2*ffn, H]``, ``layers.0.down_proj.weight``,
``norm [H]``, ``lm_head.weight [K, H]`` and, with a token map, ``token_map [K] int64`` (full-vocabulary
id of each draft id: ``d2t[i] + i``).
"""

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Dict, Optional

import torch
from torch import Tensor

EAGLE3_METHOD = "eagle3"  # the config.json "method" that marks this format


@dataclass
class Eagle3Config:
    """Shape and provenance of an EAGLE-3 draft; ``draft_vocab = 0``: no token map, K = vocab."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    target_hidden: int
    draft_vocab: int = 0
    fc_bias: bool = False
    rms_eps: float = 1e-6
    rope: Dict = field(default_factory=lambda: {"rope_theta": 10000.0, "rope_type": "default"})
    layer_prefix: str = "midlayer."  # the published name of the decoder layer (``layers.0.`` in vLLM's speculators)
    target_name: str = ""
    target_fingerprint: str = ""
    source_config: Dict = field(default_factory=dict)  # the published config.json, re-emitted on export
    method: str = EAGLE3_METHOD

    def __post_init__(self):
        for name in ("hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "target_hidden"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not 0 <= self.draft_vocab <= self.vocab:
            raise ValueError(f"draft_vocab must be in [0, vocab={self.vocab}], got {self.draft_vocab}")
        if self.method != EAGLE3_METHOD:
            raise ValueError(f"method must be {EAGLE3_METHOD!r}, got {self.method!r}")

    @property
    def head_rows(self) -> int:
        """K, the rows of the draft's own lm_head."""
        return self.draft_vocab or self.vocab

    def shapes(self) -> Dict[str, tuple]:
        """The shape of every stored tensor (see the module docstring)."""
        H, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        s = {"fc.weight": (H, 3 * self.target_hidden), "layers.0.qkv_proj.weight": (q + 2 * kv, 2 * H),
             "layers.0.o_proj.weight": (H, q), "layers.0.input_norm": (H,), "layers.0.hidden_norm": (H,),
             "layers.0.post_norm": (H,), "layers.0.gate_up_proj.weight": (2 * self.ffn, H),
             "layers.0.down_proj.weight": (H, self.ffn), "norm": (H,), "lm_head.weight": (self.head_rows, H)}
        if self.fc_bias:
            s["fc.bias"] = (H,)
        if self.draft_vocab:
            s["token_map"] = (self.draft_vocab,)
        return s


@dataclass
class Eagle3Draft:
    """An EAGLE-3 draft's config and tensors (names as in the module docstring), for conversion only."""

    config: Eagle3Config
    state: Dict[str, Tensor]

    def __post_init__(self):
        want = self.config.shapes()
        missing, extra = sorted(set(want) - set(self.state)), sorted(set(self.state) - set(want))
        if missing or extra:
            parts = [f"missing {missing}"] * bool(missing) + [f"unexpected {extra}"] * bool(extra)
            raise ValueError("EAGLE-3 draft tensors do not match its config: " + "; ".join(parts))
        for name, shape in want.items():
            if tuple(self.state[name].shape) != shape:
                raise ValueError(f"EAGLE-3 tensor {name} has shape {tuple(self.state[name].shape)}, "
                                 f"the config implies {shape}")

    def save(self, directory) -> None:
        """Write ``config.json`` and ``model.safetensors`` into ``directory``."""
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state.items()}, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(asdict(self.config), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, directory) -> "Eagle3Draft":
        from safetensors.torch import load_file

        d = Path(directory)
        data = json.loads((d / "config.json").read_text())
        known = {f.name for f in fields(Eagle3Config)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{d / 'config.json'}: unknown keys {unknown}")
        try:
            config = Eagle3Config(**data)
        except TypeError as e:  # a required field absent
            raise ValueError(f"{d / 'config.json'}: {e}") from None
        return cls(config, load_file(str(d / "model.safetensors")))


def is_eagle3_folder(config: Optional[dict]) -> bool:
    """Whether a parsed ``config.json`` is this format's."""
    return isinstance(config, dict) and config.get("method") == EAGLE3_METHOD and "hidden" in config


def as_draft_config(config: Eagle3Config, where: str = "this EAGLE-3 draft"):
    """The :class:`~poss.models.draft_config.DraftConfig` that runs an EAGLE-3 draft's tensors as a
    one-specialist ``eagle3`` :class:`~poss.models.draft.PosSDraft` (EAGLE-3's default target layers).

    ``ValueError`` when its hidden size differs from the target's (``target_hidden``): poss shares the
    target's embedding with the draft, so the two widths must agree."""
    from poss.models.draft_config import DraftConfig

    c = config
    if c.target_hidden != c.hidden:
        raise ValueError(f"{where}: its hidden size {c.hidden} differs from its target's {c.target_hidden}; "
                         "poss runs EAGLE-3 drafts as wide as their target only")
    return DraftConfig(hidden=c.hidden, heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim, ffn=c.ffn,
                       vocab=c.vocab, rope=dict(c.rope), rms_eps=c.rms_eps, fc_bias=c.fc_bias,
                       draft_vocab=c.draft_vocab, target_name=c.target_name,
                       target_fingerprint=c.target_fingerprint, features="eagle3")


def from_draft_config(config, source_config: Optional[Dict] = None) -> Eagle3Config:
    """The :class:`Eagle3Config` of a one-specialist ``eagle3`` poss draft (what ``poss export
    --format eagle3`` writes); ``ValueError`` for any other draft."""
    c = config
    if c.features != "eagle3" or c.n_specialists != 1 or c.n_feature_layers != 3:
        raise ValueError("the eagle3 layout holds one EAGLE-3 layer over three target layers; this draft has "
                         f"features {c.features!r}, {c.n_specialists} specialist(s), {c.n_feature_layers} "
                         "target layers")
    return Eagle3Config(hidden=c.hidden, heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim, ffn=c.ffn,
                        vocab=c.vocab, target_hidden=c.hidden, draft_vocab=c.draft_vocab, fc_bias=c.fc_bias,
                        rms_eps=c.rms_eps, rope=dict(c.rope), target_name=c.target_name,
                        target_fingerprint=c.target_fingerprint, source_config=dict(source_config or {}))


def token_map_from_d2t(d2t: Tensor) -> Tensor:
    """EAGLE-3's ``d2t [K]`` (offsets: target id minus draft id) as full-vocabulary ids ``[K] int64``."""
    return d2t.to(torch.int64) + torch.arange(d2t.shape[0], dtype=torch.int64)


def d2t_t2d(token_map: Tensor, vocab: int):
    """``(d2t [K] int64, t2d [vocab] bool)`` as EAGLE-3 stores them, from ``token_map [K]``."""
    token_map = token_map.to(torch.int64)
    d2t = token_map - torch.arange(token_map.shape[0], dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[token_map] = True
    return d2t, t2d
