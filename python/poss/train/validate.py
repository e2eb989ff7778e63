"""Score a trained draft on held-out conversations for any number of draft positions.

A draft's own training validation covers only the steps it was trained for (EAGLE-2 one, HASS three).
Comparing methods needs every draft scored over the same depth: this runs the aligned multi-step
objective without noise for ``steps`` positions, where step k uses specialist ``min(k // n, N - 1)``,
exactly as generation does, so a single-layer draft drafts every position with its one layer.
"""

from typing import Dict, List, Optional

import torch

from poss.models.draft import PosSDraft
from poss.models.target import TargetRunner
from poss.train.data import Example
from poss.train.ddp import DistInfo
from poss.train.features import make_features
from poss.train.loop import VAL_ID_OFFSET, TrainConfig, evaluate


def validate_draft(draft_dir, runner: TargetRunner, val_examples: List[Example], steps: int = 6,
                   feature_cache: Optional[str] = None, batch_size: int = 1, autocast: str = "bf16",
                   info: DistInfo = DistInfo()) -> Dict:
    """Per-step validation metrics of the draft in ``draft_dir`` over ``steps`` draft positions.

    Returns ``{"draft", "steps", "vloss", "ploss", "loss", "acc", "tokens"}``; ``acc[k]`` is the top-1
    agreement of the draft's step-k token with the target's at every assistant position (lists of
    length ``steps``). The draft is scored in fp32 master weights under ``autocast`` ("bf16" or "none"),
    as in training.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    draft = PosSDraft.load(draft_dir, dtype=torch.float32, device=runner.device)
    fp = draft.config.target_fingerprint
    if fp and fp != runner.fingerprint():
        raise ValueError(f"{draft_dir} was trained for another target ({draft.config.target_name})")
    features = make_features(runner, feature_cache, info.rank)
    cfg = TrainConfig(method="poss", steps=steps, batch_size=batch_size, autocast=autocast)
    ids = [VAL_ID_OFFSET + i for i in range(len(val_examples))]
    result = evaluate(draft, features, val_examples, ids, cfg, runner, info)
    if hasattr(features, "cache"):
        features.cache.flush()
    return {"draft": str(draft_dir), "steps": steps, **result}
