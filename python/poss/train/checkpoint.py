"""Resumable training state: written atomically every N minutes, so a kill loses at most one interval."""

import os
import random
from pathlib import Path
from typing import Optional

import torch

STATE = "trainer_state.pt"


def save_state(directory, draft, optimizer, scheduler, progress: dict) -> Path:
    """Write draft weights, optimizer, scheduler, progress counters and RNG states to ``directory/trainer_state.pt``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {
        "model": {k: v.detach().cpu() for k, v in draft.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "progress": dict(progress),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }
    tmp = d / (STATE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, d / STATE)  # readers never see a half-written file
    return d / STATE


def load_state(directory, draft, optimizer, scheduler, check=None) -> Optional[dict]:
    """Restore what :func:`save_state` wrote; returns the progress dict, or None when there is no state.

    ``check(progress)`` runs before anything is restored (it raises to refuse the checkpoint).
    """
    path = Path(directory) / STATE
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    if check is not None:
        check(state["progress"])
    draft.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state["progress"]
