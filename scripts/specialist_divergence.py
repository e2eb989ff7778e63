"""How far a PosS draft's position specialists have moved apart, and from a reference draft's layer.

PosS starts every specialist as a copy of one EAGLE-2 layer; specialisation is whatever training
then moves them apart. For each weight of the layer (qkv, o, gate_up, down, post-norm) this prints
the relative distance ``||W_a - W_b|| / ||W_b||`` between every pair of specialists and, with
``--against``, between each specialist and layer 0 of other drafts (e.g. the EAGLE-2 it started from
and HASS), so the specialists' spread can be read against how far training moved them at all.

    python scripts/specialist_divergence.py drafts/poss2 --against drafts/eagle2 drafts/hass
"""

import argparse
from pathlib import Path
from typing import Dict, List, Tuple

from torch import Tensor

WEIGHTS = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight", "post_norm")


def layers(draft: Path) -> Dict[int, Dict[str, Tensor]]:
    """``{specialist j: {weight name: fp32 tensor}}`` of a draft folder's ``model.safetensors``."""
    from safetensors.torch import load_file

    out: Dict[int, Dict[str, Tensor]] = {}
    for key, t in load_file(str(Path(draft) / "model.safetensors")).items():
        parts = key.split(".", 2)
        if parts[0] == "layers" and len(parts) == 3 and parts[2] in WEIGHTS:
            out.setdefault(int(parts[1]), {})[parts[2]] = t.float()
    if not out:
        raise SystemExit(f"specialist_divergence: {draft} has no layers.<j>.<weight> tensors")
    return out


def relative(a: Tensor, b: Tensor) -> float:
    """``||a - b|| / ||b||`` (Frobenius)."""
    return ((a - b).norm() / b.norm()).item()


def divergence(draft: Path, against: List[Path]) -> List[Tuple[str, Dict[str, float]]]:
    """Rows ``(label, {weight: relative distance})``: each specialist pair, then each specialist
    against layer 0 of each ``against`` draft."""
    spec = layers(draft)
    rows = []
    for a in sorted(spec):
        for b in sorted(spec):
            if a < b:
                rows.append((f"specialist {b} vs {a}", {w: relative(spec[b][w], spec[a][w]) for w in WEIGHTS}))
    for other in against:
        ref = layers(other)[0]
        for j in sorted(spec):
            rows.append((f"specialist {j} vs {other}", {w: relative(spec[j][w], ref[w]) for w in WEIGHTS}))
    return rows


def table(rows: List[Tuple[str, Dict[str, float]]]) -> str:
    head = "| pair | " + " | ".join(WEIGHTS) + " |\n|---|" + "---|" * len(WEIGHTS) + "\n"
    return head + "".join(f"| {label} | " + " | ".join(f"{v[w]:.3f}" for w in WEIGHTS) + " |\n"
                          for label, v in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("draft", type=Path, help="a PosS draft folder")
    ap.add_argument("--against", type=Path, nargs="*", default=[], help="other draft folders (their layer 0)")
    args = ap.parse_args(argv)
    print(table(divergence(args.draft, args.against)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
