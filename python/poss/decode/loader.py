"""``poss.load``: a target (registry name, HF folder or .gguf) plus an optional draft -> a Generator."""

from pathlib import Path
from typing import Optional, Union

import torch

from poss.decode.generator import Generator
from poss.decode.params import TreeParams


def load(target: Union[str, Path] = "smollm2-135m", draft: Optional[Union[str, Path]] = None,
         dtype: Union[str, torch.dtype] = "auto", device="cpu", context_limit: Optional[int] = None,
         tree: Union[TreeParams, str] = "auto") -> Generator:
    """Load the target offline and, when ``draft`` is a PosS draft folder, attach it.

    With ``draft=None`` the generator decodes autoregressively on the same runner (the baseline);
    :func:`poss.models.registry.shipped_draft` names the draft shipped for a registry target.
    ``dtype``: ``"auto"`` (the default) runs in bf16 on CUDA and on CPUs with hardware bf16 (AMX /
    AVX512-BF16), else fp32 (:func:`poss.hardware.resolve_dtype`); a name (``"bf16"``) or a torch dtype
    is used as given. ``tree``: the generator's ``default_tree``: ``"auto"`` (the default) sizes the
    draft tree for this machine, dtype and draft on the first call that needs it (timed once, about a
    minute on a small CPU, then cached on disk; :meth:`TreeParams.auto`), or a fixed
    :class:`TreeParams`. Raises ``ValueError`` when the draft was trained for a different target.
    """
    from poss.hardware import resolve_dtype
    from poss.models.draft import PosSDraft
    from poss.models.registry import load_model, resolve
    from poss.models.target import TargetRunner

    dtype = resolve_dtype(dtype, device)
    path = resolve(target)
    tokenizer, model = load_model(path, dtype=dtype, device=device)
    # Small initial caches: the generator grows them to each call's batch and length.
    runner = TargetRunner(model, max_batch=1, max_seq=256, dtype=dtype)
    d = None
    if draft is not None:
        d = PosSDraft.load(draft, dtype=dtype, device=device).attach(runner, max_batch=1, max_seq=256)
    gen = Generator(runner, tokenizer=tokenizer, draft=d, context_limit=context_limit, target_path=path,
                    generation_config=getattr(model, "generation_config", None))
    gen.default_tree = tree
    return gen
