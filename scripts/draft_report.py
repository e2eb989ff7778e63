"""Compare trained drafts over the same draft depth, plot it, and ship drafts with model cards.

    python scripts/draft_report.py runs                        # table + docs/img/draft_step_accuracy.png
    python scripts/draft_report.py runs --ship eagle2 hass poss2   # also copy them into drafts/

For every ``RUN/draft-fp16`` written by ``poss train`` (the fp16 copy is what ships) this runs
``poss train --validate`` over ``--steps`` draft positions on the run's own validation split (same data
arguments as its recipe) and keeps the result in ``RUN/val-steps<S>.json``, so reruns are free.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def validation(run: Path, steps: int) -> dict:
    out = run / f"val-steps{steps}.json"
    if out.exists():
        return json.loads(out.read_text())
    cfg = json.loads((run / "draft-fp16" / "config.json").read_text())
    data = cfg["training"]["data"]
    cmd = [sys.executable, "-m", "poss.cli", "train", "--validate", str(run / "draft-fp16"), "--steps", str(steps),
           "--target", cfg["target_name"], "--train-size", str(data.get("train_size", data["n_train"])), "--val-size", str(data["n_val"]),
           "--max-len", str(data["max_len"]), "--data-seed", str(data["data_seed"]), "--features", "cache"]
    if data.get("regenerated"):
        cmd.append("--regenerate")
    print("+", " ".join(cmd), file=sys.stderr)
    res = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    result = json.loads(res.stdout)
    out.write_text(json.dumps(result, indent=1))
    return result


def describe(run: Path, steps: int) -> dict:
    cfg = json.loads((run / "draft-fp16" / "config.json").read_text())
    t = cfg["training"]
    r, v = t["recipe"], t.get("val") or {}
    label = {"eagle2": "EAGLE-2", "hass": "HASS"}.get(r["method"], f"PosS-{r['positions_per_specialist']}")
    return {"run": run.name, "label": label, "cfg": cfg, "recipe": r, "train_val": v,
            "val": validation(run, steps), "minutes": t["train_seconds"] / 60, "tokens": t["tokens"],
            "mb": (run / "draft-fp16" / "model.safetensors").stat().st_size / 2 ** 20}


def mean(xs):
    return sum(xs) / max(1, len(xs))


def table(rows, steps: int) -> str:
    head = (f"| draft | specialists | positions trained | train time | tokens | val loss (mean @1..{steps}) | "
            + " | ".join(f"acc@{k + 1}" for k in range(steps)) + f" | mean acc@1..{steps} |")
    lines = [head, "|" + "---|" * (7 + steps)]
    for d in rows:
        acc = d["val"]["acc"]
        lines.append(f"| {d['label']} (`{d['run']}`) | {d['cfg']['n_specialists']} | {d['recipe']['steps']} | "
                     f"{d['minutes']:.0f} min | {d['tokens']:,} | {mean(d['val']['loss']):.3f} | "
                     + " | ".join(f"{100 * a:.1f}" for a in acc) + f" | {100 * mean(acc):.1f} |")
    return "\n".join(lines)


def plot(rows, steps: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dx) = plt.subplots(1, 2, figsize=(11, 4.0))
    x = range(1, steps + 1)
    for i, d in enumerate(rows):
        ax.plot(x, [100 * a for a in d["val"]["acc"]], marker="o", color=f"C{i}", label=d["label"])
    ax.set_xlabel("draft position (step)")
    ax.set_ylabel("top-1 agreement with the target (%)")
    ax.set_title(f"held-out per-step accuracy ({rows[0]['val']['tokens']:,} tokens)")
    ax.legend()
    # The methods that hold accuracy differ by tenths of a point: show them against HASS.
    hass = next((d for d in rows if d["label"] == "HASS"), None)
    if hass is not None:
        for i, d in enumerate(rows):
            if d["label"] not in ("EAGLE-2", "HASS"):
                dx.plot(x, [100 * (a - b) for a, b in zip(d["val"]["acc"], hass["val"]["acc"])], marker="o",
                        color=f"C{i}", label=d["label"])
        dx.axhline(0.0, color="gray", lw=1)
        dx.set_xlabel("draft position (step)")
        dx.set_ylabel("accuracy minus HASS's (points)")
        dx.set_title("PosS specialists vs the single HASS layer")
        dx.legend()
    for a in (ax, dx):
        a.grid(alpha=0.3)
    fig.suptitle("SmolLM2-135M-Instruct drafts")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


def model_card(d: dict, steps: int) -> str:
    c, r, data = d["cfg"], d["recipe"], d["cfg"]["training"]["data"]
    acc = " / ".join(f"{100 * a:.1f}" for a in d["val"]["acc"])
    trained_acc = " / ".join(f"{100 * a:.1f}" for a in d["train_val"].get("acc", []))
    init = "" if r["method"] == "eagle2" else " Initialised from the EAGLE-2 draft (every specialist a copy of its layer)."
    return f"""# {d['label']} draft for SmolLM2-135M-Instruct

A `poss` draft: a shared fc (2H -> H) plus {c['n_specialists']} decoder layer(s)
(hidden {c['hidden']}, {c['heads']} heads / {c['kv_heads']} KV heads, FFN {c['ffn']}), each drafting
{c['positions_per_specialist']} consecutive position(s); the last one drafts every deeper position.
The target's embedding and lm_head are shared, not stored. Weights are fp16 ({d['mb']:.1f} MB).

- **Target:** `{c['target_name']}` (fingerprint `{c['target_fingerprint']}`); loading checks it.
- **Method:** {r['method']}, {r['steps']} aligned training step(s), {c['n_specialists']} specialist(s).{init}
- **Data:** {data['source']} (file sha256 `{data['file_sha256_16']}`): {data['n_train']} training
  conversations ({d['tokens']:,} tokens, max_len {data['max_len']}, {r['epochs']} epoch), {data['n_val']}
  held out (data seed {data['data_seed']}); original assistant turns (not regenerated). The loss
  covers assistant tokens only.
- **Recipe:** AdamW lr {r['lr']:g}, betas {tuple(r['betas'])}, weight decay {r['weight_decay']}, linear warmup
  {r['warmup_frac']:.0%} then linear decay, `clip_grad_value_` {r['clip_value']}, uniform feature noise
  (std {r['noise_std']}), SmoothL1 feature loss x {r['v_weight']} + soft cross-entropy x {r['p_weight']},
  bf16 autocast, batch size {r['batch_size']}, seed {r['seed']}.
- **Training time:** {d['minutes']:.0f} min on a shared 2-core CPU (cached fp16 target features).
- **Validation (held out, at the end of training, fp32):** loss {mean(d['train_val'].get('loss', [])):.3f}
  (mean over the trained steps), top-1 agreement per trained step: {trained_acc} %.
- **Validation over {steps} draft positions (this fp16 file, `poss train --validate`):** top-1 agreement
  per step {acc} % (loss {' / '.join(f'{x:.3f}' for x in d['val']['loss'])}).

Reproduce: `scripts/train_smollm2_drafts.sh {d['run']}` (needs the EAGLE-2 run first for HASS/PosS),
then `python scripts/draft_report.py RUNS --ship {d['run']}`.
"""


def ship(d: dict, run: Path, dest: Path, steps: int) -> None:
    out = dest / d["run"]
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(run / "draft-fp16" / name, out / name)
    (out / "README.md").write_text(model_card(d, steps))
    print(f"shipped {out}", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="?", default="runs",
                    help="folder of poss train run directories (scripts/train_smollm2_drafts.sh's RUNS)")
    ap.add_argument("--steps", type=int, default=6, help="draft positions to score (the paper's 6)")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "img" / "draft_step_accuracy.png"))
    ap.add_argument("--ship", nargs="*", default=[], help="run names to copy into --dest with a model card")
    ap.add_argument("--dest", default=str(ROOT / "drafts"))
    a = ap.parse_args(argv)
    runs = sorted(p.parent.parent for p in Path(a.runs).glob("*/draft-fp16/config.json"))
    if not runs:
        print(f"no finished runs (RUN/draft-fp16/config.json) under {a.runs}", file=sys.stderr)
        return 1
    os.environ.setdefault("PYTHONPATH", f"{ROOT}:{ROOT / 'python'}")
    rows = [describe(r, a.steps) for r in runs]
    order = {"EAGLE-2": 0, "HASS": 1}
    rows.sort(key=lambda d: (order.get(d["label"], 2), d["label"]))
    print(table(rows, a.steps))
    plot(rows, a.steps, Path(a.plot))
    by_name = {d["run"]: (d, r) for d, r in zip(rows, [Path(a.runs) / d["run"] for d in rows])}
    for name in a.ship:
        if name not in by_name:
            print(f"--ship {name}: no finished run of that name under {a.runs}", file=sys.stderr)
            return 2
        ship(by_name[name][0], by_name[name][1], Path(a.dest), a.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
