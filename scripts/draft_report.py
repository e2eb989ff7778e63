"""Summarise trained drafts: ``python scripts/draft_report.py /work/runs`` -> a markdown table.

Reads each ``RUN/draft/config.json`` (written by ``poss train``): method, specialists, training time,
tokens, validation loss and per-step top-1 agreement with the target.
"""

import json
import sys
from pathlib import Path


def main(root: str) -> None:
    rows = []
    for cfg_path in sorted(Path(root).glob("*/draft/config.json")):
        c = json.loads(cfg_path.read_text())
        t = c.get("training") or {}
        r, v = t.get("recipe", {}), t.get("val") or {}
        acc = " / ".join(f"{100 * a:.1f}" for a in v.get("acc", []))
        loss = sum(v.get("loss", [])) / max(1, len(v.get("loss", [])))
        rows.append(f"| {cfg_path.parent.parent.name} | {r.get('method')} | {r.get('steps')} | {c['n_specialists']} | "
                    f"{t.get('train_seconds', 0) / 60:.0f} min | {t.get('tokens', 0)} | {loss:.3f} | {acc} |")
    print("| run | method | steps | specialists | train time | tokens | val loss (mean over steps) | val top-1 agreement per step (%) |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/work/runs")
