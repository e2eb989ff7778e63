"""Weight files as HF-style folders hold them: ``model.safetensors`` or ``pytorch_model.bin``, whole or
sharded behind an index (``*.index.json``, whose ``weight_map`` names each tensor's shard).

Published drafts ship in every one of these forms; :func:`read_weights` takes any of them and
:func:`write_weights` writes any of them. A ``.bin`` file is unpickled with ``weights_only=True``,
which refuses anything but tensors and plain containers.
"""

import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

FILE_FORMATS = ("safetensors", "bin")
_WHOLE = {"safetensors": "model.safetensors", "bin": "pytorch_model.bin"}
_INDEX = {fmt: name + ".index.json" for fmt, name in _WHOLE.items()}


def weight_files(folder) -> Tuple[str, List[Path]]:
    """``(file format, weight files)`` of ``folder``, looked for in the order safetensors, safetensors
    index, bin, bin index. ``ValueError`` naming the folder when it holds none, or when an index names a
    shard that is not there."""
    d = Path(folder)
    for fmt in FILE_FORMATS:
        if (d / _WHOLE[fmt]).is_file():
            return fmt, [d / _WHOLE[fmt]]
        index = d / _INDEX[fmt]
        if index.is_file():
            shards = sorted(set(_weight_map(index).values()))
            missing = [s for s in shards if not (d / s).is_file()]
            if missing:
                raise ValueError(f"{index} names shards that are not in {d}: {', '.join(missing)}")
            return fmt, [d / s for s in shards]
    expected = [n for fmt in FILE_FORMATS for n in (_WHOLE[fmt], _INDEX[fmt])]
    raise ValueError(f"{d} holds no weights: expected one of {', '.join(expected)}")


def _weight_map(index: Path) -> Dict[str, str]:
    try:
        data = json.loads(index.read_text())
        wm = data["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is not a weight index (JSON with a 'weight_map' object): {e}") from None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise ValueError(f"{index}: 'weight_map' must map tensor names to file names")
    return wm


def _read_one(path: Path, fmt: str) -> Dict[str, Tensor]:
    if fmt == "safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"{path} does not hold a flat name -> tensor dict")
    return state


def read_weights(folder) -> Tuple[Dict[str, Tensor], str, List[Path]]:
    """Every tensor in ``folder``'s weight files: ``(name -> tensor, file format, files read)``.

    Tensors keep the dtypes stored in the files. ``ValueError`` when a tensor is in two shards or a
    sharded checkpoint's index lists a tensor that no shard holds.
    """
    fmt, files = weight_files(folder)
    state: Dict[str, Tensor] = {}
    for f in files:
        part = _read_one(f, fmt)
        twice = sorted(set(part) & set(state))
        if twice:
            raise ValueError(f"{f}: tensors also in another shard: {', '.join(twice[:5])}")
        state.update(part)
    index = Path(folder) / _INDEX[fmt]
    if files[0].name != _WHOLE[fmt]:  # read through the index
        absent = sorted(set(_weight_map(index)) - set(state))
        if absent:
            raise ValueError(f"{index} lists tensors no shard holds: {', '.join(absent[:10])}")
    return state, fmt, files


def read_names(folder) -> List[str]:
    """The tensor names in ``folder``'s weight files, read without loading the tensors where the format allows."""
    fmt, files = weight_files(folder)
    if files[0].name != _WHOLE[fmt]:  # sharded: the index names every tensor
        return sorted(_weight_map(Path(folder) / _INDEX[fmt]))
    if fmt == "safetensors":
        from safetensors import safe_open

        with safe_open(str(files[0]), framework="pt") as f:
            return sorted(f.keys())
    return sorted(_read_one(files[0], fmt))


def write_weights(folder, state: Dict[str, Tensor], fmt: str = "safetensors",
                  max_shard_bytes: Optional[int] = None) -> List[Path]:
    """Write ``state`` into ``folder`` as ``fmt`` (``"safetensors"`` or ``"bin"``); returns the files written.

    With ``max_shard_bytes`` the tensors (in name order) are split into shards of at most that many
    bytes each (a larger tensor gets a shard of its own), named ``model-00001-of-0000N.safetensors``
    (``pytorch_model-…bin``) beside an index ``*.index.json`` whose ``metadata.total_size`` counts
    every tensor's bytes, as ``transformers`` writes them.
    """
    if fmt not in FILE_FORMATS:
        raise ValueError(f"file format must be one of {', '.join(FILE_FORMATS)}, got {fmt!r}")
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    # Own copies: views that share storage (q/k/v split from one qkv) are refused by safetensors.
    state = {k: v.detach().cpu().clone(memory_format=torch.contiguous_format) for k, v in state.items()}
    shards: List[List[str]] = [[]]
    size = 0
    for name in sorted(state):
        n = state[name].numel() * state[name].element_size()
        if max_shard_bytes is not None and shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    if max_shard_bytes is None:
        names = [_WHOLE[fmt]]
    else:
        names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))]
    written = []
    for names_in, file_name in zip(shards, names):
        part = {k: state[k] for k in names_in}
        tmp = d / f"{file_name}.{os.getpid()}.tmp"
        try:
            if fmt == "safetensors":
                from safetensors.torch import save_file

                save_file(part, str(tmp), metadata={"format": "pt"})
            else:
                torch.save(part, str(tmp))
            os.replace(tmp, d / file_name)
        finally:
            tmp.unlink(missing_ok=True)
        written.append(d / file_name)
    if max_shard_bytes is not None:
        total = sum(t.numel() * t.element_size() for t in state.values())
        weight_map = {k: f for names_in, f in zip(shards, names) for k in names_in}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (d / _INDEX[fmt]).write_text(json.dumps(index, indent=2) + "\n")
        written.append(d / _INDEX[fmt])
    return written
