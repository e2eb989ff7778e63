"""A copy of a PosS draft in which every position runs one of its specialists.

Scoring the copy (``poss train --validate``) beside the draft itself shows what the specialists
add at their own positions: if specialist 0 at positions 3-6 scores as well as the specialists
trained for them, the draft is one layer in effect.

    python scripts/uniform_specialist.py drafts/poss2 runs/poss2-all0 --specialist 0
    poss train --data runs/distill-bf16 --validate runs/poss2-all0 --steps 6 --threads 1
"""

import argparse
from pathlib import Path


def uniform(src: Path, dst: Path, j: int) -> Path:
    """Save the draft in ``src`` to ``dst`` with every specialist's weights replaced by specialist
    ``j``'s (config, shared fc and token map unchanged)."""
    import torch

    from poss.models.draft import PosSDraft

    d = PosSDraft.load(src, dtype=torch.float16)
    n = d.config.n_specialists
    if not 0 <= j < n:
        raise SystemExit(f"uniform_specialist: --specialist must be in [0, {n}) for {src}, got {j}")
    with torch.no_grad():
        for layer in d.layers:
            for p, q in zip(layer.parameters(), d.layers[j].parameters()):
                p.copy_(q)
    d.save(dst)
    return dst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="a PosS draft folder")
    ap.add_argument("dst", type=Path, help="the folder to write")
    ap.add_argument("--specialist", type=int, required=True, help="the specialist every position runs")
    args = ap.parse_args(argv)
    print(uniform(args.src, args.dst, args.specialist))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
