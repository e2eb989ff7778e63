"""``poss.load``: a target (registry name, HF folder or .gguf) plus an optional draft -> a Generator."""

from pathlib import Path
from typing import Optional, Union

import torch

from poss.generator import Generator

# Installed: poss/drafts (package data); source tree: <repo>/drafts.
_INSTALLED_DRAFTS = Path(__file__).resolve().parent / "drafts"
DRAFTS_DIR = _INSTALLED_DRAFTS if _INSTALLED_DRAFTS.is_dir() else Path(__file__).resolve().parents[2] / "drafts"


def load(target: Union[str, Path] = "smollm2-135m", draft: Optional[Union[str, Path]] = None,
         dtype: torch.dtype = torch.float32, device="cpu", context_limit: Optional[int] = None) -> Generator:
    """Load the target offline and, when ``draft`` is a PosS draft folder, attach it.

    With ``draft=None`` the generator decodes autoregressively on the same runner (the baseline).
    Raises ``ValueError`` when the draft was trained for a different target.
    """
    from poss.models.draft import PosSDraft
    from poss.models.registry import load_model, resolve
    from poss.models.target import TargetRunner

    path = resolve(target)
    tokenizer, model = load_model(path, dtype=dtype, device=device)
    runner = TargetRunner(model, max_batch=1, max_seq=256, dtype=dtype)
    d = None
    if draft is not None:
        d = PosSDraft.load(draft, dtype=dtype, device=device).attach(runner, max_batch=1, max_seq=256)
    gen = Generator(runner, tokenizer=tokenizer, draft=d, context_limit=context_limit, target_path=path,
                    generation_config=getattr(model, "generation_config", None))
    return gen


def shipped_draft(target: str) -> Optional[Path]:
    """The draft shipped in ``drafts/`` for registry target ``target`` (a PosS one first), or None."""
    if not DRAFTS_DIR.is_dir():
        return None
    import json

    found = []
    for cfg in sorted(DRAFTS_DIR.glob("*/config.json")):
        try:
            name = json.loads(cfg.read_text()).get("target_name", "")
        except ValueError:
            continue
        if name == target and (cfg.parent / "model.safetensors").exists():
            found.append(cfg.parent)
    found.sort(key=lambda p: ("poss" not in p.name.lower(), p.name))
    return found[0] if found else None
