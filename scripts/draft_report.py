"""Compare trained drafts over the same draft depth: held-out accuracy tables, two plots and the EAGLE-2
learning curve, the records a training round's docs cite.

    python scripts/draft_report.py runs                            # tables + the two plots
    poss release draft runs/poss2                                  # then ship a run, with its model card

Every finished run (``RUN/draft-fp16``, the fp16 copy that ships) and the shared initialisation the runs
started from (``--init``, their ``--init-from``) are scored by ``poss train --validate DRAFT --steps 6``
on one held-out split: on-policy drafts (``training.data.source == "poss distill"``) on the ``--data``
folder's, older ShareGPT drafts on the split their own recipe names. A result is kept in
``RUN/val-steps<S>.json`` (the init's under the poss cache) together with the draft's hash, the split's
fingerprint and the dtype, so reruns are free and a retrained draft or a new split is scored again;
``poss release draft RUN`` writes its model card from that file.

The EAGLE-2 learning curve plots held-out acc@1 against cumulative token-passes: the init run's epochs
(``--init-curve``: measured on a machine that is gone), the init draft re-scored here, and every run's
per-epoch validations (``val_epoch`` lines of ``RUN/metrics.jsonl``) counted from where the init stopped.

Relative paths in the arguments are taken from the repository root.
"""

import argparse
import datetime
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
# poss is imported here too (dtype, data fingerprints), not only by the validation subprocesses.
sys.path[:0] = [p for p in (str(ROOT / "python"), str(ROOT)) if p not in sys.path]

from poss.train import draft_card  # noqa: E402  (after the path: this checkout's poss)
from poss.train.draft_card import (  # noqa: E402
    cumulative_tokens,
    describe,
    draft_precision,
    file_digest,
    init_of,
    mean,
    method_label,
    on_policy,
    precision,
    read_json,
    target_title,
)

METHOD_ORDER = {"eagle2": 0, "hass": 1, "poss": 2}


# -- reading drafts and runs -------------------------------------------------------------------------

def shown(path) -> str:
    """A path as the tables show it: repository-relative, else its last two parts (no machine paths)."""
    return draft_card.shown(path, ROOT)


def repo_path(p) -> Path:
    p = Path(p)
    return p if p.is_absolute() else ROOT / p


def run_config(run: Path) -> Optional[dict]:
    """The run's draft config: the final fp16 copy, else (still training) its best epoch so far."""
    for sub in ("draft-fp16", "best"):
        if (run / sub / "config.json").is_file():
            return read_json(run / sub / "config.json")
    return None


def val_epochs(run: Path) -> List[dict]:
    """The run's per-epoch held-out validations, one per epoch (a resumed run may log an epoch twice: the
    last counts).
    """
    by_epoch = {}
    path = run / "metrics.jsonl"
    for line in (path.read_text().splitlines() if path.is_file() else []):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill: the file is appended while the run trains
        if "val_epoch" in rec:
            by_epoch[rec["val_epoch"]["epoch"]] = rec["val_epoch"]
    return [by_epoch[e] for e in sorted(by_epoch)]


# -- validation over the same draft depth ----------------------------------------------------------

def validation_precision(dtype: str) -> Tuple[str, str]:
    """The target dtype and draft autocast of ``poss train --validate --dtype dtype``: resolved as for
    training (``auto`` is fp32 on a CPU without hardware bf16), the draft's as training next to it."""
    from poss.hardware import resolve_dtype
    from poss.train.validate import draft_autocast

    resolved = resolve_dtype(dtype, training=True)
    return str(resolved).replace("torch.", ""), draft_autocast(resolved)


@functools.lru_cache(maxsize=None)
def distill_split(data_dir: Path, max_len: int, n_val: int) -> dict:
    from poss.train.data import data_fingerprint
    from poss.train.distill import load_examples

    val = load_examples(data_dir, "val", max_len)[:n_val]
    return {"split": f"poss distill {shown(data_dir)}", "val_fingerprint": data_fingerprint(val), "n_val": len(val)}


def heldout_split(cfg: dict, data_dir: Path) -> dict:
    """The held-out split a draft is scored on. Its fingerprint keys the cache: a grown or replaced data
    folder must not reuse an old score, and the tables say which split the numbers are on."""
    d = cfg["training"]["data"]
    if on_policy(cfg):
        return distill_split(data_dir, d["max_len"], d["n_val"])
    # A ShareGPT draft (the old recipe): its own data arguments re-create the split it was trained with.
    return {"split": d["source"], "val_fingerprint": d["val_fingerprint"], "n_val": d["n_val"]}


def validate_command(draft: Path, cfg: dict, steps: int, data_dir: Path, dtype: str, threads: int) -> List[str]:
    d = cfg["training"]["data"]
    cmd = [sys.executable, "-m", "poss.cli", "train", "--validate", str(draft), "--steps", str(steps),
           "--target", cfg["target_name"], "--max-len", str(d["max_len"]), "--val-size", str(d["n_val"]),
           "--features", "cache", "--dtype", dtype, "--threads", str(threads)]
    if on_policy(cfg):
        return cmd + ["--data", str(data_dir)]
    cmd += ["--train-size", str(d.get("train_size", d["n_train"])), "--data-seed", str(d["data_seed"])]
    return cmd + (["--regenerate"] if d.get("regenerated") else [])


def validation(draft: Path, cfg: dict, cache: Path, a) -> dict:
    """``poss train --validate`` of ``draft`` over ``a.steps`` positions, from ``cache`` when its key still holds."""
    split = heldout_split(cfg, a.data)
    if split["val_fingerprint"] != cfg["training"]["data"].get("val_fingerprint"):
        print(f"note: {shown(draft)} is scored on a held-out split ({split['val_fingerprint']}) other than the one "
              f"it was validated on in training ({cfg['training']['data'].get('val_fingerprint')})", file=sys.stderr)
    key = {"draft_sha256_16": file_digest(draft / "model.safetensors"), "steps": a.steps, "dtype": a.dtype_name,
           "autocast": a.autocast, **split}
    if cache.is_file():
        got = read_json(cache)
        if got.get("key") == key:
            return got
    cmd = validate_command(draft, cfg, a.steps, a.data, a.dtype_name, a.threads)
    print("+", " ".join(cmd), file=sys.stderr)
    # This checkout's poss and compiled ops first, whatever PYTHONPATH the caller had.
    path = os.pathsep.join([str(ROOT), str(ROOT / "python")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "PYTHONPATH": path}
    res = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=env)
    result = {"key": key, **json.loads(res.stdout)}
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(result, indent=1))
    return result


def sort_key(d: dict):
    r = d["recipe"]
    return (d["run"] is not None, METHOD_ORDER.get(r["method"], 3), r["positions_per_specialist"], d["name"])


# -- the per-position table and plot ----------------------------------------------------------------

def table(rows: List[dict], steps: int) -> str:
    head = (f"| draft | specialists | positions trained | epochs | train time | token-passes | "
            f"val loss (mean @1..{steps}) | " + " | ".join(f"acc@{k + 1}" for k in range(steps))
            + f" | mean acc@1..{steps} |")
    lines = [head, "|" + "---|" * (8 + steps)]
    for d in rows:
        t, acc = d["cfg"]["training"], d["val"]["acc"]
        epochs = t.get("epoch") or d["recipe"]["epochs"]
        where = f"`{d['name']}`" if d["run"] is not None else f"`{shown(d['draft'])}`"
        lines.append(f"| {d['label']} ({where}) | {d['cfg']['n_specialists']} | {d['recipe']['steps']} | {epochs} | "
                     f"{d['minutes']:.0f} min | {d['tokens']:,} | {mean(d['val']['loss']):.3f} | "
                     + " | ".join(f"{100 * a:.1f}" for a in acc) + f" | {100 * mean(acc):.1f} |")
    return "\n".join(lines)


def scored_on(rows: List[dict]) -> str:
    """One line naming the held-out split(s) and the precision every row was scored in."""
    keys = {(d["val"]["key"]["split"], d["val"]["key"]["val_fingerprint"], d["val"]["key"]["n_val"], d["val"]["tokens"])
            for d in rows}
    splits = "; ".join(f"{s} (fingerprint `{fp}`, {n} conversations, {tok:,} answer tokens)"
                       for s, fp, n, tok in sorted(keys))
    k = rows[0]["val"]["key"]
    return f"held-out split: {splits}; target {k['dtype']}, draft {draft_precision(k['autocast'])}"


def plot_steps(rows: List[dict], steps: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dx) = plt.subplots(1, 2, figsize=(12, 4.4))
    x = range(1, steps + 1)
    # One color per method; the drafts that are not runs of this report (an init, baselines) dashed.
    methods = sorted({(METHOD_ORDER.get(d["recipe"]["method"], 3), d["recipe"]["positions_per_specialist"])
                      for d in rows})
    colors = {id(d):
              f"C{methods.index((METHOD_ORDER.get(d['recipe']['method'], 3), d['recipe']['positions_per_specialist']))}"
              for d in rows}
    for d in rows:
        style = {"ls": "--", "alpha": 0.6, "color": colors[id(d)]} if d["run"] is None else {"color": colors[id(d)]}
        ax.plot(x, [100 * a for a in d["val"]["acc"]], marker="o", label=d["label"], **style)
    k = rows[0]["val"]["key"]
    ax.set_xlabel("draft position (step)")
    ax.set_ylabel("top-1 agreement with the target (%)")
    ax.set_title(f"held-out per-step accuracy ({rows[0]['val']['tokens']:,} tokens)\n"
                 f"target {k['dtype']}, draft {draft_precision(k['autocast'])}", fontsize=10)
    ax.legend()
    # The methods that hold accuracy differ by tenths of a point: show them against HASS.
    hass = next((d for d in rows if d["recipe"]["method"] == "hass" and d["run"] is not None), None)
    others = [d for d in rows if d["recipe"]["method"] == "poss" and d["run"] is not None]
    for d in others if hass else []:
        dx.plot(x, [100 * (a - b) for a, b in zip(d["val"]["acc"], hass["val"]["acc"])], marker="o",
                color=colors[id(d)], label=d["label"])
    if hass and others:
        dx.legend()
    else:
        dx.text(0.5, 0.5, "no finished HASS run yet" if not hass else "no finished PosS run yet",
                ha="center", va="center", transform=dx.transAxes, color="gray")
    dx.axhline(0.0, color="gray", lw=1)
    dx.set_xlabel("draft position (step)")
    dx.set_ylabel("accuracy minus HASS's (points)")
    dx.set_title("PosS specialists vs the single HASS layer", fontsize=10)
    for a in (ax, dx):
        a.grid(alpha=0.3)
    fig.suptitle(f"{target_title(rows[0]['cfg'])} drafts")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)


# -- the EAGLE-2 learning curve ---------------------------------------------------------------------

def learning_curves(init_curve: dict, runs: List[Path], init_row: Optional[dict],
                    init_dir: Optional[Path], past: List[dict] = ()) -> List[dict]:
    """Curves of (token-passes, acc@1, epoch) points: the init run's, the init draft re-scored here, the
    ``past`` runs' (an earlier report's run curves, whose run folders are gone), and every run with per-epoch
    validations, counted from where the init stopped when it started from it (``start``: the re-scored init,
    drawn as the first point of the line, not listed again in the table). A run here replaces a past curve
    of the same label."""
    base = init_curve["points"][-1]["tokens"]
    curves = [{"label": init_curve["label"], "measured": init_curve["measured"], "kind": "init", "start": None,
               "points": [(p["tokens"], p["acc1"], p["epoch"]) for p in init_curve["points"]]}]
    rescored = None
    if init_row is not None:
        t, k = init_row["cfg"]["training"], init_row["val"]["key"]
        if cumulative_tokens(t) != base:
            print(f"note: --init has {cumulative_tokens(t):,} token-passes, the init curve ends at {base:,}",
                  file=sys.stderr)
        rescored = (cumulative_tokens(t), init_row["val"]["acc"][0], t.get("epoch"))
        measured = f"target {k['dtype']}, draft {draft_precision(k['autocast'])}"
        curves.append({"label": f"{init_row['label']} re-scored here", "kind": "rescored", "start": None,
                       "points": [rescored], "measured": measured})
    for run in runs:
        cfg, points = run_config(run), val_epochs(run)
        if cfg is None or not points or cfg["training"]["recipe"]["method"] != "eagle2":
            continue
        init = init_of(cfg, run, init_dir)
        offset = (init.get("tokens") or 0) if init else 0
        # The line starts at the re-scored init only when the run started from that draft (an earlier round's
        # run, also on the curve, started from another).
        recorded_path = (cfg["training"].get("init_from") or {}).get("path")
        from_init = init is not None and (not init["recorded"] or (
            init_dir is not None and repo_path(recorded_path).resolve() == init_dir.resolve()))
        curves.append({"label": f"{method_label(cfg['training']['recipe'])} (`{run.parent.name}/{run.name}`)",
                       "kind": "run",
                       "measured": f"per-epoch validation, {precision(cfg['training'])}",
                       "start": rescored if from_init else None,
                       "points": [(offset + p["tokens"], p["val"]["acc"][0], p["epoch"]) for p in points]})
    live = {c["label"] for c in curves}
    kept = [{**c, "start": None, "points": [tuple(p) for p in c["points"]]} for c in past if c["label"] not in live]
    first_run = 2 if rescored else 1  # the past runs go before the live ones, after the init lines
    return curves[:first_run] + kept + curves[first_run:]


def read_past_curves(path: Optional[Path]) -> List[dict]:
    """The run curves an earlier report saved (``--curve-json``); none without a file."""
    if path is None:
        return []
    return [c for c in read_json(path)["curves"] if c["kind"] == "run"]


def write_curves(curves: List[dict], path: Path) -> None:
    """Every curve as drawn, so a later report keeps the runs whose folders this machine will lose."""
    keep = [{"label": c["label"], "kind": c["kind"], "measured": c["measured"],
             "points": [list(p) for p in c["points"]]} for c in curves]
    note = ("Written by scripts/draft_report.py: the EAGLE-2 learning curve's points, each [token-passes, held-out "
            "acc@1, epoch]. A later report reads it back with --past-curves.")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"note": note, "curves": keep}, indent=1) + "\n")


def curve_table(curves: List[dict]) -> str:
    lines = ["| curve | epoch | token-passes | held-out acc@1 | measured |", "|---|---|---|---|---|"]
    for c in curves:
        for tokens, acc, epoch in c["points"]:
            lines.append(f"| {c['label']} | {'–' if epoch is None else epoch} | {tokens:,} | {100 * acc:.1f}% | "
                         f"{c['measured']} |")
    return "\n".join(lines)


def plot_curves(curves: List[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    for i, c in enumerate(curves):
        pts = ([c["start"]] if c["start"] else []) + c["points"]
        xs, ys = [p[0] / 1e6 for p in pts], [100 * p[1] for p in pts]
        label = f"{c['label']} ({c['measured']})".replace("`", "")  # Markdown quotes, not mathtext
        if c["kind"] == "rescored":
            ax.plot(xs, ys, "*", ms=14, color="black", label=label, zorder=3)
        elif c["kind"] == "init":
            ax.plot(xs, ys, marker="o", ls="--", color="gray", label=label)
        else:
            ax.plot(xs, ys, marker="o", color=f"C{i}", label=label)
    ax.set_xlabel("cumulative token-passes (millions)")
    ax.set_ylabel("held-out top-1 accuracy at step 1 (%)")
    ax.set_title("EAGLE-2 learning curve; later runs continue from the shared init", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)


# -- main ---------------------------------------------------------------------------------------------

def report_text(rows: List[dict], curves: List[dict], a) -> str:
    from poss.hardware import header

    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return f"""# Draft accuracy over {a.steps} draft positions

`python scripts/draft_report.py RUNS --data {shown(a.data)}` ({today}): every finished run's fp16 draft and the
shared init scored by `poss train --validate DRAFT --steps {a.steps}`; {scored_on(rows)}; \
on {header(a.dtype_name, a.threads)}.
acc@k is the top-1 agreement of the draft's k-th step with the target; token-passes count each run's own training
tokens (the init's are not included); train time is wall-clock.

{table(rows, a.steps)}

![per-step accuracy](../img/{a.plot.name})

## EAGLE-2 learning curve

Held-out top-1 accuracy at step 1 against cumulative token-passes: the init run's epochs ({shown(a.init_curve)}),
the init draft re-scored here, and each run's per-epoch validations (`val_epoch` in `RUN/metrics.jsonl`), counted
on top of the init's token-passes.

{curve_table(curves)}

![learning curve](../img/{a.curve_plot.name})
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="?", default="runs",
                    help="folder of poss train run directories (scripts/train_drafts.sh's RUNS)")
    ap.add_argument("--data", default="runs/distill", help="the `poss distill` folder on-policy drafts are scored on")
    ap.add_argument("--init", default="drafts/eagle2",
                    help="the shared initialisation the runs started from (its row, and their cards when the "
                         "run's config does not record --init-from); 'none' to leave it out")
    ap.add_argument("--init-label", default=None, help="the init's row label (default: '<method> init')")
    ap.add_argument("--baselines", nargs="*", default=[],
                    help="more draft folders to score on the same split (e.g. the drafts a second round started from)")
    ap.add_argument("--baseline-label", default="before",
                    help="added to each baseline's row label; FOLDER=LABEL in --baselines gives one its own")
    ap.add_argument("--init-curve", default="docs/bench/eagle2_init_curve.json",
                    help="the init run's per-epoch validations (measured elsewhere)")
    ap.add_argument("--curve-runs", nargs="*", default=[],
                    help="more EAGLE-2 run folders whose per-epoch validations join the learning curve "
                         "(e.g. the earlier rounds' runs)")
    ap.add_argument("--past-curves", default=None,
                    help="an earlier report's --curve-json: its run curves join the learning curve (their run "
                         "folders may be gone)")
    ap.add_argument("--curve-json", default="docs/bench/eagle2_learning_curve.json",
                    help="where the learning curve's points are written")
    ap.add_argument("--steps", type=int, default=6, help="draft positions to score (the paper's 6)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="the target's dtype")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads of each validation")
    ap.add_argument("--table", default="docs/bench/draft_accuracy.md")
    ap.add_argument("--plot", default="docs/img/draft_step_accuracy.png")
    ap.add_argument("--curve-plot", default="docs/img/eagle2_learning_curve.png")
    a = ap.parse_args(argv)
    for name in ("runs", "data", "init_curve", "table", "plot", "curve_plot", "curve_json"):
        setattr(a, name, repo_path(getattr(a, name)))
    a.past_curves = a.past_curves and repo_path(a.past_curves)
    a.init = None if a.init == "none" else repo_path(a.init)

    a.dtype_name, a.autocast = validation_precision(a.dtype)
    run_dirs = sorted(p for p in a.runs.iterdir() if p.is_dir()) if a.runs.is_dir() else []
    finished = [r for r in run_dirs if (r / "draft-fp16" / "config.json").is_file()]
    if not finished:
        print(f"no finished runs (RUN/draft-fp16/config.json) under {a.runs}", file=sys.stderr)
        return 1
    rows = []
    for run in finished:
        cfg = read_json(run / "draft-fp16" / "config.json")
        val = validation(run / "draft-fp16", cfg, run / f"val-steps{a.steps}.json", a)
        rows.append(describe(run.name, run / "draft-fp16", cfg, val, run, init_of(cfg, run, a.init)))
    init_row = None
    if a.init is not None:
        from poss.models.downloads import cache_root

        cfg = read_json(a.init / "config.json")
        cache = cache_root() / "draft-report" / f"{a.init.name}-val-steps{a.steps}.json"
        epoch = cfg["training"].get("epoch")
        label = a.init_label or f"{method_label(cfg['training']['recipe'])} init" + (
            f" (epoch {epoch})" if epoch else "")
        init_row = describe(a.init.name, a.init, cfg, validation(a.init, cfg, cache, a), None, None, label)
        rows.append(init_row)
    for arg in a.baselines:
        folder, _, own_label = arg.partition("=")
        base = repo_path(folder)
        if a.init is not None and base.resolve() == a.init.resolve():
            continue
        from poss.models.downloads import cache_root

        cfg = read_json(base / "config.json")
        cache = (cache_root() / "draft-report"
                 / f"{base.name}-{file_digest(base / 'model.safetensors')}-val-steps{a.steps}.json")
        label = f"{method_label(cfg['training']['recipe'])} {own_label or a.baseline_label}"
        rows.append(describe(base.name, base, cfg, validation(base, cfg, cache, a), None, None, label))
    rows.sort(key=sort_key)
    curves = learning_curves(read_json(a.init_curve), [repo_path(r) for r in a.curve_runs] + run_dirs, init_row,
                             a.init, read_past_curves(a.past_curves))
    print(table(rows, a.steps))
    print()
    print(curve_table(curves))
    plot_steps(rows, a.steps, a.plot)
    plot_curves(curves, a.curve_plot)
    write_curves(curves, a.curve_json)
    a.table.parent.mkdir(parents=True, exist_ok=True)
    a.table.write_text(report_text(rows, curves, a))
    print(f"wrote {a.table}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
