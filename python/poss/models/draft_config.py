"""The PosS draft's configuration: its shape, the specialist schedule and the target it was made for."""

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Dict, List

DRAFT_VOCABS = ("trained", "full")  # PosSDraft.load's vocab: the rows of the target's lm_head a draft scores
# What a draft's layers read: "last", the target's final-norm feature fused with the token embedding
# (EAGLE-1/2, HASS, PosS); "eagle3", several target layers fused by fc, EAGLE-3's layer (input and hidden
# norms, q/k/v over [embedding; hidden]) and the draft's own final norm and lm_head.
DRAFT_FEATURES = ("last", "eagle3")


@dataclass
class DraftConfig:
    """Everything needed to rebuild a PosS draft; stored as ``config.json`` beside the weights.

    ``n_specialists = 1`` is EAGLE-2 / HASS. Draft position p (1-based) uses specialist
    ``min((p - 1) // positions_per_specialist, n_specialists - 1)``, or, with a ``schedule`` (how many
    positions each specialist drafts, e.g. ``[1, 5]``: specialist 0 drafts position 1, specialist 1
    positions 2-6), the specialist whose span holds p; the last one also drafts every deeper position.
    ``fc_per_specialist``: each specialist has its own fusion layer ``fc`` (the PosS reference ties one).

    ``features = "eagle3"`` (:data:`DRAFT_FEATURES`): ``fc`` fuses the target's hidden states at
    ``feature_layers`` (hidden-state indices, :func:`poss.models.target.eagle3_feature_layers`; empty:
    EAGLE-3's default for the target it attaches to, and then three layers) into the first draft step's
    input; deeper steps read the draft's own output. One specialist is EAGLE-3; several are PosS on
    EAGLE-3 features.
    """

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope: Dict = field(default_factory=lambda: {"rope_theta": 10000.0, "rope_type": "default"})
    rms_eps: float = 1e-5
    n_specialists: int = 1
    positions_per_specialist: int = 1
    fc_bias: bool = True
    schedule: List[int] = field(default_factory=list)  # positions per specialist; [] = positions_per_specialist
    fc_per_specialist: bool = False
    draft_vocab: int = 0  # K > 0: the draft scores only K tokens (its ``token_map``); 0: the full vocabulary
    target_name: str = ""
    target_fingerprint: str = ""
    training: Dict = field(default_factory=dict)  # recipe + data fingerprint, written by poss.train
    features: str = "last"  # DRAFT_FEATURES
    feature_layers: List[int] = field(default_factory=list)  # "eagle3": target hidden-state indices; [] = default

    def __post_init__(self):
        for name in ("hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "n_specialists",
                     "positions_per_specialist", "draft_vocab"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (name != "draft_vocab"):
                raise ValueError(f"{name} must be an integer >= {int(name != 'draft_vocab')}, got {v!r}")
        if self.n_specialists < 1 or self.positions_per_specialist < 1:
            raise ValueError("n_specialists and positions_per_specialist must be >= 1")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.schedule:
            if (not isinstance(self.schedule, list) or len(self.schedule) != self.n_specialists
                    or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in self.schedule)):
                raise ValueError(f"schedule must list a positive number of positions for each of the "
                                 f"{self.n_specialists} specialists, got {self.schedule!r}")
        if not 0 <= self.draft_vocab <= self.vocab:
            raise ValueError(f"draft_vocab must be in [0, vocab={self.vocab}], got {self.draft_vocab}")
        if self.features not in DRAFT_FEATURES:
            raise ValueError(f"features must be one of {', '.join(DRAFT_FEATURES)}, got {self.features!r}")
        if not isinstance(self.feature_layers, list) or any(
                not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in self.feature_layers):
            raise ValueError(f"feature_layers must list non-negative hidden-state indices, got {self.feature_layers!r}")
        if self.features == "last" and self.feature_layers:
            raise ValueError("feature_layers needs features 'eagle3' (a 'last' draft reads the final-norm feature)")
        if self.features == "eagle3" and self.fc_per_specialist:
            raise ValueError("features 'eagle3' fuses the target layers once per round (one fc), "
                             "so fc_per_specialist must be false")

    @property
    def n_feature_layers(self) -> int:
        """How many target layers an ``eagle3`` draft's fc reads (EAGLE-3's three by default); 0 for ``last``."""
        return 0 if self.features == "last" else (len(self.feature_layers) or 3)

    def specialist_for(self, position: int) -> int:
        """Specialist index drafting 1-based draft position ``position``."""
        if position < 1:
            raise ValueError(f"draft positions are 1-based, got {position}")
        if self.schedule:
            end = 0
            for j, n in enumerate(self.schedule):
                end += n
                if position <= end:
                    return j
            return len(self.schedule) - 1
        return min((position - 1) // self.positions_per_specialist, self.n_specialists - 1)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: Path) -> "DraftConfig":
        """The config in ``path``; ``ValueError`` naming the file and the field when it is malformed."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
        if "ppl" in data:  # the key's older name
            data.setdefault("positions_per_specialist", data.pop("ppl"))
        known = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        unknown, missing = sorted(set(data) - known), sorted(required - set(data))
        if unknown or missing:
            raise ValueError(f"{path}: " + "; ".join(
                [f"unknown keys {unknown}"] * bool(unknown) + [f"missing keys {missing}"] * bool(missing)))
        try:
            return cls(**data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def check_target(self, fingerprint: str, what: str = "this draft") -> None:
        """Raise ``ValueError`` unless the target weights ``fingerprint`` are those this draft was made for.

        A config without a recorded fingerprint (a hand-made draft) matches every target.
        """
        if self.target_fingerprint and fingerprint != self.target_fingerprint:
            raise ValueError(
                f"{what} was trained for another target ({self.target_name!r}, weights {self.target_fingerprint}), "
                f"but this target has different weights ({fingerprint}); load the matching target")

    @classmethod
    def for_target(cls, hf_config, name: str, fingerprint: str, **kw) -> "DraftConfig":
        """A draft shaped like the target's layers (EAGLE's choice)."""
        heads = hf_config.num_attention_heads
        rope = getattr(hf_config, "rope_parameters", None) or {"rope_theta": getattr(hf_config, "rope_theta", 1e4)}
        return cls(hidden=hf_config.hidden_size, heads=heads, kv_heads=hf_config.num_key_value_heads,
                   head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
                   ffn=hf_config.intermediate_size, vocab=hf_config.vocab_size, rope=dict(rope),
                   rms_eps=float(hf_config.rms_norm_eps), target_name=name, target_fingerprint=fingerprint,
                   **kw)
