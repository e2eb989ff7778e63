"""The model card of a trained draft, written from its ``config.json`` and its held-out validation.

A draft's config records its recipe, data, machine and (``training.init_from``) the draft it started
from; :func:`describe` gathers that with a ``poss train --validate`` result into one row, which
:func:`model_card` turns into the ``README.md`` shipped next to the weights
(:func:`poss.train.release.release_draft`). Pure functions on dicts and files: no torch, no model.
"""

import hashlib
import json
from pathlib import Path
from typing import Optional

DRIVER_TRAIN_SIZE = 1000  # scripts/train_drafts.sh's TRAIN_SIZE when none is given
DRIVER_TARGET, DRIVER_VOCAB = "smollm2-135m", 8192  # its TARGET and VOCAB defaults


def read_json(path) -> dict:
    return json.loads(Path(path).read_text())


def shown(path, root=None) -> str:
    """A path as cards and tables show it: relative to ``root`` (default: the working directory, the
    repository's root where drafts are released), else its last two parts (no machine paths)."""
    if not Path(path).is_absolute():
        return str(path)  # as recorded or typed (relative to where the run started)
    p = Path(path).resolve()
    try:
        return str(p.relative_to(Path(root or Path.cwd()).resolve()))
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


def cumulative_tokens(training: dict) -> int:
    """Token-passes of a draft's training and of every draft it started from: the ``tokens_total`` its
    ``init_from`` summary records (configs before that nest the init's whole ``training`` record)."""
    init = training.get("init_from") or {}
    sources = init.get("sources") or [init]
    before = [s["tokens_total"] if s.get("tokens_total") is not None
              else cumulative_tokens(s["training"]) if s.get("training") else 0 for s in sources]
    return training["tokens"] + max(before, default=0)


def init_summary_record(folder) -> dict:
    """What a trained draft's config records of a draft it started from (one level, no nested lineage):
    its folder (as given), weights fingerprint, method, epochs, token-passes so far and held-out acc@1."""
    folder = Path(folder)
    cfg = read_json(folder / "config.json")
    t = cfg.get("training") or {}
    weights = folder / "model.safetensors"
    return {"path": str(folder), "fingerprint": file_digest(weights) if weights.is_file() else None,
            "method": method_label(t["recipe"]) if t.get("recipe") else None, "epoch": t.get("epoch"),
            "epochs": (t.get("recipe") or {}).get("epochs"), "tokens_total": cumulative_tokens(t) if t else None,
            "acc1": (t.get("val") or {}).get("acc", [None])[0]}


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
        rec = (rec.get("sources") or [rec])[-1]  # two sources: the later specialists' (the larger lineage)
        if rec.get("training"):  # a config from before init_from was a one-level summary
            facts = init_summary({"training": rec["training"]}, rec["path"])
        else:
            facts = {"path": rec["path"], "label": rec.get("method"), "epoch": rec.get("epoch"),
                     "epochs": rec.get("epochs"), "tokens": rec.get("tokens_total"), "acc1": rec.get("acc1")}
        return {**facts, "recorded": True}
    if init_dir is None or not on_policy(cfg) or (run is not None and run.resolve() in init_dir.resolve().parents):
        return None
    return {**init_summary(read_json(init_dir / "config.json"), init_dir), "recorded": False}


def describe(name: str, draft: Path, cfg: dict, val: dict, run: Optional[Path], init: Optional[dict],
             label: Optional[str] = None) -> dict:
    t = cfg["training"]
    return {"name": name, "label": label or method_label(t["recipe"]), "cfg": cfg, "recipe": t["recipe"],
            "train_val": t.get("val") or {}, "val": val, "run": run, "draft": draft, "init": init,
            "minutes": t["train_seconds"] / 60, "tokens": t["tokens"],
            "mb": (draft / "model.safetensors").stat().st_size / 1e6}


def mean(xs):
    return sum(xs) / max(1, len(xs))


def pct(xs) -> str:
    return " / ".join(f"{100 * x:.1f}" for x in xs)


def draft_precision(autocast: str) -> str:
    """A draft's precision in words, from its autocast ("bf16" or "none"); its master weights are fp32 either way."""
    return "bf16 autocast" if autocast == "bf16" else "fp32, no autocast"


def precision(training: dict) -> str:
    """The training precision as recorded: the recipe's autocast, and the target's dtype where the run recorded it."""
    dtype = (training.get("machine") or {}).get("dtype")
    return draft_precision(training["recipe"].get("autocast")) + (f", target {dtype}" if dtype else "")


def target_title(cfg: dict) -> str:
    """The target's model name from its registry file name (``SmolLM2-135M-Instruct.Q4_1.gguf``), else its key."""
    import re

    from poss.models.registry import REGISTRY

    entry = REGISTRY.get(cfg["target_name"])
    if entry is None:
        return cfg["target_name"]
    return re.sub(r"(\.Q\w+)?\.gguf$", "", entry.filename)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def architecture(c: dict, recipe: dict) -> str:
    layers = (f"{c['n_specialists']} decoder layers, the position specialists (each drafts "
              f"{plural(c['positions_per_specialist'], 'consecutive position')}, the last one also every deeper one)"
              if recipe["method"] == "poss" else "1 decoder layer that drafts every position")
    if c.get("features") == "eagle3":
        layers_at = c.get("feature_layers") or "at the EAGLE-3 default layers"
        fc = (f"a fc fusing the target's hidden states {layers_at} (3H -> H), EAGLE-3 layers (q/k/v over "
              "[embedding; hidden]) and its own final norm and lm_head, ")
        return (f"A `poss` draft on EAGLE-3 features: {fc}{layers}; hidden {c['hidden']}, {c['heads']} heads / "
                f"{c['kv_heads']} KV heads, FFN {c['ffn']}.")
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
    elif r.get("draft_features") == "eagle3":
        name = "EAGLE-3" if r["method"] == "eagle3" else f"PosS-{r['positions_per_specialist']} on EAGLE-3 features"
        what = (f"{name}: EAGLE-3's training-time test over {r['steps']} steps (the draft's own outputs fed back, "
                "gradients through them; cross-entropy only)")
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
    knobs = [f"TARGET={c['target_name']}"] if c["target_name"] != DRIVER_TARGET else []
    if c.get("draft_vocab") and c["draft_vocab"] != DRIVER_VOCAB:
        knobs.append(f"VOCAB={c['draft_vocab']}")
    knobs += [f"DATA=<the {data['dtype']} poss distill folder>"] if on_policy(c) else []
    if data.get("train_start"):  # a later round: each method from its own earlier draft, on the new answers
        folder = str(Path(init["path"]).parent) if init else "DRAFTS"
        knobs += [f"INIT_EACH={folder}", f"TRAIN_START={data['train_start']}"]
    elif init:
        knobs.append(f"INIT={init['path']}")
    if data.get("train_size") and data["train_size"] != DRIVER_TRAIN_SIZE:
        knobs.append(f"TRAIN_SIZE={data['train_size']}")
    run_name = d["run"].name if d["run"] is not None else d["name"]
    if d["run"] is not None and d["run"].parent.name != "runs":
        knobs.append(f"RUNS={shown(d['run'].parent)}")
    if run_name == "eagle2-init":  # the driver's init run: its schedule is INIT_ARGS, not EPOCHS
        knobs.append(f'INIT_ARGS="--epochs {r["epochs"]}' + (f' --max-batches {r["max_batches"]}"'
                                                             if r.get("max_batches") else '"'))
    elif r["epochs"] != 1:
        knobs.append(f"EPOCHS={r['epochs']}")
    driver = " ".join(knobs + [f"scripts/train_drafts.sh {run_name}"])
    release_run = shown(d["run"]) if d["run"] is not None else f"runs/{d['name']}"
    if d["run"] is not None and d["run"].name != d["name"]:
        release_run += f" --name {d['name']}"
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

Reproduce: `{driver}`, then `poss release draft {release_run}`.
"""
