"""Validation: per-step metrics of a draft on held-out conversations, during training and after it.

:func:`evaluate` is what the trainer reports at the end of a run. :func:`validate_draft` scores any
saved draft for any number of draft positions: a draft's own training validation covers only the
steps it was trained for (EAGLE-2 one, HASS three), and comparing methods needs every draft scored
over the same depth. Step k uses specialist ``min(k // n, N - 1)``, exactly as generation does, so a
single-layer draft drafts every position with its one layer.
"""

from typing import Dict, List, Optional, Sequence

import torch

from poss.models.draft import PosSDraft
from poss.models.target import TargetRunner
from poss.train.data import Example, collate
from poss.train.ddp import DistInfo, all_reduce_sum
from poss.train.features import VAL_ID_OFFSET, make_features
from poss.train.objective import Objective, make_batch, position_weights, run_steps


@torch.no_grad()
def evaluate(draft: PosSDraft, features, examples: Sequence[Example], ids: Sequence[int], obj: Objective,
             runner: TargetRunner, batch_size: int = 1, autocast_dtype: Optional[torch.dtype] = torch.bfloat16,
             info: DistInfo = DistInfo()) -> Dict:
    """Per-step metrics of ``obj.steps`` steps without noise; rows are pooled over the set and over ranks.

    ``features(input_ids, lengths, ids)`` gives the target features of a batch (``ids``: feature-cache
    keys of ``examples``). Returns ``{"vloss", "ploss", "loss", "acc"}`` (lists of length ``obj.steps``)
    and ``"tokens"``, the number of scored rows.
    """
    S = obj.steps
    sums = torch.zeros(S, 4, dtype=torch.float64)  # vloss*M, ploss*M, correct, count
    mine = list(range(info.rank, len(examples), info.world))
    for s in range(0, len(mine), batch_size):
        chunk = mine[s:s + batch_size]
        b = collate([examples[i] for i in chunk])
        f = features(b["input_ids"], b["lengths"], [ids[i] for i in chunk])
        batch = make_batch(b["input_ids"].to(f.device), b["loss_mask"].to(f.device), b["lengths"], f, runner.lm_head,
                           token_map=draft.token_map, next_token=b["next_token"])
        for k, m in enumerate(run_steps(draft, batch, runner.embed, runner.lm_head, runner.inv_freq, obj,
                                        backward=False, autocast_dtype=autocast_dtype)):
            M = float(m["count"])
            sums[k] += torch.tensor([float(m["vloss"]) * M, float(m["ploss"]) * M, float(m["correct"]), M],
                                    dtype=torch.float64)
    sums = all_reduce_sum(sums, info)
    M = sums[:, 3].clamp(min=1)
    vl, pl = (sums[:, 0] / M), (sums[:, 1] / M)
    return {"vloss": vl.tolist(), "ploss": pl.tolist(), "loss": (obj.v_weight * vl + obj.p_weight * pl).tolist(),
            "acc": (sums[:, 2] / M).tolist(), "tokens": int(sums[0, 3])}


def draft_autocast(target_dtype: torch.dtype) -> str:
    """The draft's precision in training and validation next to a target in ``target_dtype``: bf16
    autocast ("bf16") with a bf16 target, which ``resolve_dtype(..., training=True)`` picks only on CPUs
    with hardware bf16 (and on CUDA), else fp32 ("none")."""
    return "bf16" if target_dtype == torch.bfloat16 else "none"


def validate_draft(draft_dir, runner: TargetRunner, val_examples: List[Example], steps: int = 6,
                   feature_cache: Optional[str] = None, batch_size: int = 1, autocast: Optional[str] = None,
                   info: DistInfo = DistInfo()) -> Dict:
    """Per-step validation metrics of the draft in ``draft_dir`` over ``steps`` draft positions.

    Returns ``{"draft", "steps", "vloss", "ploss", "loss", "acc", "tokens"}``; ``acc[k]`` is the top-1
    agreement of the draft's step-k token with the target's at every assistant position (lists of
    length ``steps``). The draft is scored in fp32 master weights under ``autocast`` ("bf16" or "none";
    default: :func:`draft_autocast` of the runner's dtype, as training next to this runner), with the
    training objective's default loss weights.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    autocast = draft_autocast(runner.dtype) if autocast is None else autocast
    if autocast not in ("bf16", "none"):
        raise ValueError(f"autocast must be 'bf16' or 'none', got {autocast!r}")
    draft = PosSDraft.load(draft_dir, dtype=torch.float32, device=runner.device)
    draft.config.check_target(runner.fingerprint(), what=str(draft_dir))
    runner.set_feature_layers(draft.feature_layers_for(len(runner.layers)))  # an EAGLE-3 draft's target layers
    features = make_features(runner, feature_cache, info.rank)
    ids = [VAL_ID_OFFSET + i for i in range(len(val_examples))]
    ac = torch.bfloat16 if autocast == "bf16" else None
    obj = Objective(steps=steps)
    if draft.eagle3:  # EAGLE-3's loss: the soft cross-entropy only, 0.8^k weights
        obj = Objective(steps=steps, v_weight=0.0, p_weight=1.0, position_weights=position_weights("eagle3", steps))
    result = evaluate(draft, features, val_examples, ids, obj, runner, batch_size, ac, info)
    if hasattr(features, "cache"):
        features.cache.flush()
    return {"draft": str(draft_dir), "steps": steps, **result}
