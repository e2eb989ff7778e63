"""Compare trained drafts over the same draft depth, plot them, and ship drafts with model cards.

    python scripts/draft_report.py runs                            # tables + the two plots
    python scripts/draft_report.py runs --ship eagle2 hass poss2   # also copy them into drafts/ with a card

Every finished run (``RUN/draft-fp16``, the fp16 copy that ships) and the shared initialisation the runs
started from (``--init``, their ``--init-from``) are scored by ``poss train --validate DRAFT --steps 6``
on one held-out split: on-policy drafts (``training.data.source == "poss distill"``) on the ``--data``
folder's, older ShareGPT drafts on the split their own recipe names. A result is kept in
``RUN/val-steps<S>.json`` (the init's under the poss cache) together with the draft's hash, the split's
fingerprint and the dtype, so reruns are free and a retrained draft or a new split is scored again.

The EAGLE-2 learning curve plots held-out acc@1 against cumulative token-passes: the init run's epochs
(``--init-curve``: measured on a machine that is gone), the init draft re-scored here, and every run's
per-epoch validations (``val_epoch`` lines of ``RUN/metrics.jsonl``) counted from where the init stopped.

Relative paths in the arguments are taken from the repository root.
"""

import argparse
import datetime
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
# poss is imported here too (dtype, data fingerprints), not only by the validation subprocesses.
sys.path[:0] = [p for p in (str(ROOT / "python"), str(ROOT)) if p not in sys.path]

METHOD_ORDER = {"eagle2": 0, "hass": 1, "poss": 2}
DRIVER_TRAIN_SIZE = 1000  # scripts/train_smollm2_drafts.sh's TRAIN_SIZE when none is given


# -- reading drafts and runs -------------------------------------------------------------------------

def read_json(path) -> dict:
    return json.loads(Path(path).read_text())


def repo_path(p) -> Path:
    p = Path(p)
    return p if p.is_absolute() else ROOT / p


def shown(path) -> str:
    """A path as cards and tables show it: repository-relative, else its last two parts (no machine paths)."""
    if not Path(path).is_absolute():
        return str(path)  # as recorded or typed (relative to where the run started)
    p = Path(path).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(Path(*p.parts[-2:]))


def method_label(recipe: dict) -> str:
    return {"eagle2": "EAGLE-2", "hass": "HASS"}.get(recipe["method"]) or f"PosS-{recipe['positions_per_specialist']}"


def on_policy(cfg: dict) -> bool:
    return cfg["training"]["data"].get("source") == "poss distill"


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]


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


def cumulative_tokens(training: dict) -> int:
    """Token-passes of a draft's training and of every draft it started from (its ``init_from`` chain)."""
    init = training.get("init_from") or {}
    return training["tokens"] + (cumulative_tokens(init["training"]) if init.get("training") else 0)


def init_summary(cfg: dict, path) -> dict:
    t = cfg["training"]
    return {"path": shown(path), "label": method_label(t["recipe"]), "epoch": t.get("epoch"),
            "epochs": t["recipe"]["epochs"], "tokens": cumulative_tokens(t),
            "acc1": (t.get("val") or {}).get("acc", [None])[0]}


def init_of(cfg: dict, run: Optional[Path], init_dir: Optional[Path]) -> Optional[dict]:
    """The draft a run started from (``--init-from``), or None when unknown or none.

    Newer configs record it (``training.init_from``); older ones do not, and an on-policy run is then taken to
    have started from ``init_dir`` (the driver script's INIT, which the report is told with ``--init``),
    unless the run is that init itself.
    """
    t = cfg["training"]
    if "init_from" in t:
        rec = t["init_from"]
        if rec is None:
            return None
        facts = (init_summary({"training": rec["training"]}, rec["path"]) if rec.get("training")
                 else {"path": rec["path"]})
        return {**facts, "recorded": True}
    if init_dir is None or not on_policy(cfg) or (run is not None and run.resolve() in init_dir.resolve().parents):
        return None
    return {**init_summary(read_json(init_dir / "config.json"), init_dir), "recorded": False}


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


def describe(name: str, draft: Path, cfg: dict, val: dict, run: Optional[Path], init: Optional[dict],
             label: Optional[str] = None) -> dict:
    t = cfg["training"]
    return {"name": name, "label": label or method_label(t["recipe"]), "cfg": cfg, "recipe": t["recipe"],
            "train_val": t.get("val") or {}, "val": val, "run": run, "draft": draft, "init": init,
            "minutes": t["train_seconds"] / 60, "tokens": t["tokens"],
            "mb": (draft / "model.safetensors").stat().st_size / 1e6}


def sort_key(d: dict):
    r = d["recipe"]
    return (d["run"] is not None, METHOD_ORDER.get(r["method"], 3), r["positions_per_specialist"], d["name"])


# -- the per-position table and plot ----------------------------------------------------------------

def mean(xs):
    return sum(xs) / max(1, len(xs))


def pct(xs) -> str:
    return " / ".join(f"{100 * x:.1f}" for x in xs)


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


def target_title(cfg: dict) -> str:
    """The target's model name from its registry file name (``SmolLM2-135M-Instruct.Q4_1.gguf``), else its key."""
    import re

    from poss.models.registry import REGISTRY

    entry = REGISTRY.get(cfg["target_name"])
    if entry is None:
        return cfg["target_name"]
    return re.sub(r"(\.Q\w+)?\.gguf$", "", entry.filename)


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

def draft_precision(autocast: str) -> str:
    """A draft's precision in words, from its autocast ("bf16" or "none"); its master weights are fp32 either way."""
    return "bf16 autocast" if autocast == "bf16" else "fp32, no autocast"


def precision(training: dict) -> str:
    """The training precision as recorded: the recipe's autocast, and the target's dtype where the run recorded it."""
    dtype = (training.get("machine") or {}).get("dtype")
    return draft_precision(training["recipe"].get("autocast")) + (f", target {dtype}" if dtype else "")


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


# -- model cards and shipping -----------------------------------------------------------------------

def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def architecture(c: dict, recipe: dict) -> str:
    layers = (f"{c['n_specialists']} decoder layers, the position specialists (each drafts "
              f"{plural(c['positions_per_specialist'], 'consecutive position')}, the last one also every deeper one)"
              if recipe["method"] == "poss" else "1 decoder layer that drafts every position")
    return (f"A `poss` draft: a shared fc (2H -> H) plus {layers}; hidden {c['hidden']}, {c['heads']} heads / "
            f"{c['kv_heads']} KV heads, FFN {c['ffn']}.")


def vocabulary(c: dict) -> str:
    k, v = c.get("draft_vocab") or 0, c["vocab"]
    if not k:
        return f"It scores the target's full {v:,}-token vocabulary."
    return (f"It scores a **reduced vocabulary of {k:,} tokens** (the most frequent tokens of its training answers; "
            f"`token_map` in `model.safetensors`, `draft_vocab` in `config.json`): drafting is cheaper, and "
            f"verification still uses the full {v:,}-token vocabulary, so the output is unchanged (K only changes "
            "how often drafts are accepted).")


def method_text(c: dict, r: dict) -> str:
    if r["method"] == "eagle2":
        what = "EAGLE-2: 1 teacher-forced step (the draft sees the target's features only)"
    else:
        name = "HASS" if r["method"] == "hass" else f"PosS-{r['positions_per_specialist']}"
        what = f"{name}: {r['steps']} aligned training steps (the draft's own features feed the later ones)"
    if r["method"] != "poss":
        return f"{what}; 1 layer for every position"
    return (f"{what}; {c['n_specialists']} specialists, "
            f"{plural(c['positions_per_specialist'], 'position')} per specialist")


def answers(d: dict) -> str:
    """The training answers a run used: all of a set's, or (``--train-start``) a slice of it."""
    n = d.get("train_size", d["n_train"])
    start = d.get("train_start", 0)
    if not start:
        return f"{n:,} training answers"
    return f"{n:,} training answers (keys {start:,}..{start + n - 1:,}: those after the {start:,} earlier rounds saw)"


def data_text(d: dict, epochs: int) -> str:
    if d.get("source") == "poss distill":
        return (f"on-policy: the target's own {d['decoding']} answers ({d['dtype']}, at most {d['max_new_tokens']} new "
                f"tokens) to prompts from {d['prompt_source']}, made by `poss distill`: {answers(d)} "
                f"({d['train_tokens']:,} tokens with their prompts, max_len {d['max_len']}), {d['n_val']} "
                f"held-out prompts answered the same way (fingerprints: training `{d['train_fingerprint']}`, "
                f"held-out `{d['val_fingerprint']}`). The loss covers answer tokens only")
    return (f"{d['source']} (file sha256 `{d['file_sha256_16']}`): {d['n_train']} training conversations "
            f"({d['train_tokens']:,} tokens, max_len {d['max_len']}, {plural(epochs, 'epoch')}), {d['n_val']} held out "
            f"(data seed {d['data_seed']}); {'regenerated' if d.get('regenerated') else 'original'} assistant turns. "
            "The loss covers assistant tokens only")


def init_text(init: Optional[dict], r: dict) -> str:
    if init is None:
        return "none recorded (a random initialisation, or a config from before `poss train` recorded `--init-from`)"
    facts = [init.get("label"),
             f"epoch {init['epoch']} of {init['epochs']} planned" if init.get("epoch") and init.get("epochs") else None,
             f"{init['tokens']:,} token-passes" if init.get("tokens") else None,
             f"held-out acc@1 {100 * init['acc1']:.1f} %" if init.get("acc1") is not None else None,
             None if init["recorded"] else "the driver script's INIT, not recorded in this config",
             # A later round continues the shipped draft in place: the folder now holds this draft.
             "the draft this one replaced in `drafts/` (git: the commit before this file's)"
             if Path(init["path"]).parts[:1] == ("drafts",) else None]
    copies = {"eagle2": "training continues from its weights", "hass": "the layer starts as a copy of its layer"}
    return (f"`--init-from {init['path']}` ({', '.join(f for f in facts if f)}); "
            + copies.get(r["method"], "every specialist starts as a copy of its layer"))


def machine_text(t: dict) -> str:
    m = t.get("machine")  # poss.hardware.describe() facts, where the training run recorded them
    where = (f"{m['cpu']} ({', '.join(m.get('simd', []))}; {plural(m['threads'], 'thread')})" if m
             else "a shared 2-core CPU")
    return where + (f" x {t['world_size']} processes" if t.get("world_size", 1) > 1 else "")


def model_card(d: dict, steps: int) -> str:
    c, r, t = d["cfg"], d["recipe"], d["cfg"]["training"]
    data, init, v, k = t["data"], d["init"], d["val"], d["val"]["key"]
    epochs = t.get("epoch") or r["epochs"]
    passes = f"{d['tokens']:,} token-passes" + (f" ({init['tokens'] + d['tokens']:,} with the init's)"
                                                if init and init.get("tokens") else "")
    seconds = f" ({t['train_seconds']:.0f} s)" if d["minutes"] < 10 else ""
    losses = f"SmoothL1 feature loss x {r['v_weight']} + soft cross-entropy x {r['p_weight']}" + (
        f" + top-K loss x {r['topk_weight']}" if r.get("topk_weight") else "")
    stop = f", stopped after {r['max_batches']} optimizer steps" if r.get("max_batches") else ""
    misses = (f" Rows whose target token is outside the {c['draft_vocab']:,} count as misses."
              if c.get("draft_vocab") else "")
    title = target_title(c) + (", on-policy data" if on_policy(c) else "") + (
        f", {c['draft_vocab']:,}-token draft vocabulary" if c.get("draft_vocab") else "")
    # The driver's knobs that differ from its defaults, so the line reruns this draft's recipe.
    knobs = [f"DATA=<the {data['dtype']} poss distill folder>"] if on_policy(c) else []
    if data.get("train_start"):  # a later round: each method from its own earlier draft, on the new answers
        folder = str(Path(init["path"]).parent) if init else "DRAFTS"
        knobs += [f"INIT_EACH={folder}", f"TRAIN_START={data['train_start']}"]
    elif init:
        knobs.append(f"INIT={init['path']}")
    if data.get("train_size") and data["train_size"] != DRIVER_TRAIN_SIZE:
        knobs.append(f"TRAIN_SIZE={data['train_size']}")
    if r["epochs"] != 1:
        knobs.append(f"EPOCHS={r['epochs']}")
    driver = " ".join(knobs + [f"scripts/train_smollm2_drafts.sh {d['name']}"])
    return f"""# {d['label']} draft for {title}

{architecture(c, r)} {vocabulary(c)} The target's embedding and lm_head are shared, not stored.
Weights are fp16 ({d['mb']:.1f} MB).

- **Target:** `{c['target_name']}` (fingerprint `{c['target_fingerprint']}`); loading checks it.
- **Method:** {method_text(c, r)}.
- **Data:** {data_text(data, epochs)}.
- **Initialisation:** {init_text(init, r)}.
- **Recipe:** {plural(epochs, 'epoch')}, {passes}; AdamW lr {r['lr']:g}, betas {tuple(r['betas'])}, \
weight decay {r['weight_decay']}, linear warmup {r['warmup_frac']:.0%} then linear decay over \
{plural(r['epochs'], 'epoch')}{stop}, `clip_grad_value_` {r['clip_value']}, uniform feature noise \
(std {r['noise_std']}), {losses}, {precision(t)}, batch size {r['batch_size']}, seed {r['seed']}.
- **Training time:** {d['minutes']:.0f} min{seconds} on {machine_text(t)}, cached target features.
- **Validation at the end of training** (held out, {precision(t)}): \
loss {mean(d['train_val'].get('loss', [])):.3f} (mean over the trained steps), \
top-1 agreement per trained step {pct(d['train_val'].get('acc', []))} %.
- **Validation over {steps} draft positions** (this fp16 file, `poss train --validate --steps {steps}`, \
target {k['dtype']}, draft {draft_precision(k['autocast'])}, {v['tokens']:,} held-out answer tokens, \
split `{k['val_fingerprint']}`): top-1 agreement per position {pct(v['acc'])} % \
(loss {' / '.join(f'{x:.3f}' for x in v['loss'])}).{misses}

Reproduce: `{driver}`, then `python scripts/draft_report.py runs --ship {d['name']}`.
"""


def ship(d: dict, dest: Path, steps: int) -> None:
    out = dest / d["name"]
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(d["draft"] / name, out / name)
    (out / "README.md").write_text(model_card(d, steps))
    print(f"shipped {out}", file=sys.stderr)


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
                    help="folder of poss train run directories (scripts/train_smollm2_drafts.sh's RUNS)")
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
    ap.add_argument("--ship", nargs="*", default=[], help="run names to copy into --dest with a model card")
    ap.add_argument("--dest", default="drafts")
    a = ap.parse_args(argv)
    for name in ("runs", "data", "init_curve", "table", "plot", "curve_plot", "curve_json", "dest"):
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
    by_name = {d["name"]: d for d in rows if d["run"] is not None}
    for name in a.ship:
        if name not in by_name:
            print(f"--ship {name}: no finished run of that name under {a.runs}", file=sys.stderr)
            return 2
        ship(by_name[name], a.dest, a.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
