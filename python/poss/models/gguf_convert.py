"""One-time GGUF -> HF safetensors conversion, so later loads skip the 20-70 s dequantisation."""

import contextlib
import os
import shutil
from pathlib import Path

import torch
from tqdm.auto import tqdm

from poss.models.downloads import scratch_path


def clear_quantization_marker(model) -> None:
    """Make a GGUF-loaded model saveable.

    transformers loads GGUF weights dequantised but keeps a ``GgufHfQuantizer`` on the model and a
    ``quantization_config`` in its config, and ``save_pretrained`` refuses such a model. The
    quantizer's own ``remove_quantization_config`` is the supported way to drop both markers.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    elif hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise ``gguf_path`` into an fp32 HF folder ``out_dir`` (model + tokenizer), atomically.

    Each call writes into a folder of its own beside ``out_dir`` and renames it into place, so processes
    converting the same model at once never touch each other's files; the first rename wins and the
    others drop their copy.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from poss.models.target import check_architecture

    if (out_dir / "config.json").exists():
        return out_dir
    tmp = scratch_path(out_dir, ".tmp")
    tmp.mkdir(parents=True)
    try:
        steps = ["read + dequantise GGUF", "tokenizer", "save safetensors"]
        with tqdm(total=len(steps), desc=f"converting {gguf_path.name}", unit="step") as bar:
            bar.set_postfix_str(steps[0])
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
            )
            check_architecture(model.config)
            bar.update(1)
            bar.set_postfix_str(steps[1])
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            bar.update(1)
            bar.set_postfix_str(steps[2])
            clear_quantization_marker(model)
            model.save_pretrained(str(tmp))
            tokenizer.save_pretrained(str(tmp))
            bar.update(1)
        _move_into_place(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed conversion, or the copy of one that lost the race
    return out_dir


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    for attempt in range(2):
        try:
            os.rename(tmp, out_dir)
            return
        except OSError:
            if (out_dir / "config.json").exists():
                return  # another process finished the same conversion first: use theirs
            if attempt:
                raise
        # A folder without config.json is no finished conversion (an older poss could rename a half-written
        # one into place); set it aside rather than failing on it forever.
        stale = scratch_path(out_dir, ".stale")
        with contextlib.suppress(FileNotFoundError):
            os.rename(out_dir, stale)
        shutil.rmtree(stale, ignore_errors=True)
