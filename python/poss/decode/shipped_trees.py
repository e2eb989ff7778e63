"""Trees for ``tree="auto"`` before this machine was timed: measured in advance for each CPU class and
dtype, shipped with each draft as ``trees.json`` beside its ``config.json``.

The file maps ``"<class>/<dtype>"`` (class: :func:`poss.hardware.cpu_class`, or ``cuda``; dtype:
``bfloat16`` / ``float32`` / ``float16``) to a tree (``"N/D"`` or ``"N/D+K"``, as
:func:`poss.decode.params.tree_spec` reads it), the batch size up to which rounds still speculate, and
where the figures were measured::

    {"trees": {"avx2/bfloat16": {"tree": "2/1+4", "speculate_max_batch": 1, "source": "..."}}}

A machine with no entry gets :data:`FALLBACK`: a tree that costs about one decode step wherever the
GEMM takes two rows in one pass over the weights, and that speculates only for one request.
"""

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from poss.decode.params import TreeParams, tree_spec

FILE = "trees.json"


@dataclass(frozen=True)
class ShippedTree:
    """A tree chosen without timing: ``tree``, ``speculate_max_batch`` (None: no limit) and ``source``,
    a few words on where it comes from."""

    tree: TreeParams
    speculate_max_batch: Optional[int]
    source: str


# One draft token per round: on every CPU measured so far a 2-row verify cost about a decode step and
# the first draft level about a tenth of one, so it loses little where the draft is weak. On a GPU a
# tree row is nearly free (docs/gpu.md: a 60-node round cost about 2 decode steps on an H200).
FALLBACK = {"cpu": ShippedTree(TreeParams(num_nodes=2, depth=1), 1, "fallback (no tree measured for this machine)"),
            "cuda": ShippedTree(TreeParams(), 1, "fallback (no tree measured for this GPU)")}


def machine_class(device: torch.device, dtype: torch.dtype) -> str:
    """The key of this machine in ``trees.json``: ``"<cpu class or cuda>/<dtype>"``."""
    from poss.hardware import cpu_class

    kind = "cuda" if device.type == "cuda" else cpu_class()
    return f"{kind}/{str(dtype).replace('torch.', '')}"


def shipped_tree(draft_dir: Optional[Path], device: torch.device, dtype: torch.dtype,
                 beam_width: int = TreeParams.beam_width) -> ShippedTree:
    """The tree shipped in ``draft_dir/trees.json`` for this machine, with ``beam_width``; the
    :data:`FALLBACK` where there is no draft folder, no file or no entry for the machine."""
    key = machine_class(device, dtype)
    fallback = FALLBACK["cuda" if device.type == "cuda" else "cpu"]
    entry = None
    path = Path(draft_dir) / FILE if draft_dir is not None else None
    if path is not None and path.is_file():
        try:
            entry = json.loads(path.read_text())["trees"].get(key)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a trees file ({e})") from None
    if entry is None:
        return replace(fallback, tree=replace(fallback.tree, beam_width=beam_width))
    try:
        tree = replace(tree_spec(entry["tree"]), beam_width=beam_width)
        limit = entry.get("speculate_max_batch")
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"speculate_max_batch must be an int >= 1 or null, got {limit!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: bad entry {key!r} ({e})") from None
    return ShippedTree(tree, limit, f"shipped for {key}")
