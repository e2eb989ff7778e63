"""One-time GGUF -> HF safetensors conversion, so later loads skip the 20-70 s dequantisation."""

import shutil
from pathlib import Path

import torch
from tqdm.auto import tqdm


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
    """Dequantise ``gguf_path`` into an fp32 HF folder ``out_dir`` (model + tokenizer), atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from poss.models.target import check_architecture

    if (out_dir / "config.json").exists():
        return out_dir
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
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
    tmp.rename(out_dir)
    return out_dir
