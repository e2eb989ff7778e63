"""``results.json``, ``table.md``, ``pos_acc.png`` and ``tau.png`` from an eval's ``records.jsonl``."""

import json
import math
from pathlib import Path
from typing import Dict, List

from poss.eval.intervals import paired_difference
from poss.eval.metrics import add_hists, mean_tau, pos_acc, question_hists, speedup, summarize
from poss.hardware import describe


def build(records: List[dict], depth: int, settings: Dict, threads=None, dtype="float32", extra=None) -> Dict:
    """Per method and dataset: the summary (:func:`summarize`), speedup over ``ar``, and
    losslessness (greedy turns token-identical to ``ar``'s)."""
    methods: Dict[str, Dict] = {}
    for r in records:
        m = methods.setdefault(r["method"], {"draft": r.get("draft"), "datasets": {}, "questions": {}})
        m["datasets"].setdefault(r["dataset"], []).append(r)
    ar = methods.get("ar")
    ar_recs = {(r["dataset"], r["question_id"]): r for rs in (ar["datasets"].values() if ar else []) for r in rs}
    ar_ids = {k: [t["token_ids"] for t in r["turns"]] for k, r in ar_recs.items()}

    def paired_speedup(rs: List[dict]) -> float:
        # Over the questions both answered: prompts differ a lot in speed, so a partial run (or a
        # different --limit) must not be timed against another set of prompts.
        rs = [r for r in rs if (r["dataset"], r["question_id"]) in ar_recs]
        if not rs:
            return math.nan
        a = summarize(rs, depth, intervals=False)
        b = summarize([ar_recs[(r["dataset"], r["question_id"])] for r in rs], depth, intervals=False)
        return speedup(a["tokens"], a["seconds"], b["tokens"], b["seconds"])

    out = {"settings": settings, "machine": describe(dtype, threads), "methods": {}}
    for name, m in methods.items():
        per = {ds: summarize(rs, depth) for ds, rs in m["datasets"].items()}
        allq = [r for rs in m["datasets"].values() for r in rs]
        overall = summarize(allq, depth)
        for ds, s in list(per.items()) + [("overall", overall)]:
            s["speedup"] = paired_speedup(m["datasets"][ds] if ds != "overall" else allq)
        same = total = 0
        if settings.get("temperature", 0) == 0 and ar_ids:
            for r in allq:
                want = ar_ids.get((r["dataset"], r["question_id"]))
                if want is not None:
                    total += 1
                    same += [t["token_ids"] for t in r["turns"]] == want
        entry = {"draft": m["draft"], "datasets": per, "overall": overall, "identical": [same, total]}
        entry.update((extra or {}).get(name, {}))
        out["methods"][name] = entry
    out["comparisons"] = comparisons(methods, depth)
    return out


def comparisons(methods: Dict[str, Dict], depth: int) -> List[Dict]:
    """Every pair of draft methods, A listed after B: A - B in tau and pos-acc per depth over the questions
    both answered, each with its paired 95 % bootstrap interval."""
    drafts = [n for n in methods if n not in ("ar", "hf")]
    keyed = {n: {(r["dataset"], r["question_id"]): r for rs in methods[n]["datasets"].values() for r in rs}
             for n in drafts}
    out = []
    for j, a in enumerate(drafts):
        for b in drafts[:j]:
            common = sorted(set(keyed[a]) & set(keyed[b]), key=str)
            if not common:
                continue
            d = paired_difference(question_hists([keyed[a][k] for k in common]),
                                  question_hists([keyed[b][k] for k in common]), depth)
            out.append({"a": a, "b": b, "questions": len(common), "tau": list(d["tau"]),
                        "pos_acc": [list(x) for x in d["pos_acc"]]})
    return out

def _fmt(x: float, nd=2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _fmt_ci(ci, nd=2, signed=False) -> str:
    if not ci or any(math.isnan(v) for v in ci):
        return ""
    f = "+" if signed else ""
    return f" [{ci[0]:{f}.{nd}f}, {ci[1]:{f}.{nd}f}]"


def table(results: Dict) -> str:
    """The paper's layout: methods as rows; tau and speedup per dataset and their mean."""
    methods = results["methods"]
    sets = sorted({ds for m in methods.values() for ds in m["datasets"]})
    head = ("| method | " + " | ".join(f"{ds} tau | {ds} speedup" for ds in sets)
            + " | mean tau | mean speedup | tau, all questions [95 %] | identical |")
    lines = [head, "|" + "---|" * (2 * len(sets) + 5)]
    for name, m in methods.items():
        cells = []
        taus, sps = [], []
        for ds in sets:
            s = m["datasets"].get(ds)
            t = s["tau"] if s and name not in ("ar", "hf") else float("nan")
            sp = s["speedup"] if s else float("nan")
            cells += [_fmt(t), _fmt(sp) + ("×" if not math.isnan(sp) else "")]
            taus.append(t)
            sps.append(sp)
        mt = sum(taus) / len(taus) if taus and not any(math.isnan(x) for x in taus) else float("nan")
        ms = sum(sps) / len(sps) if sps and not any(math.isnan(x) for x in sps) else float("nan")
        same, total = m["identical"]
        ident = f"{same}/{total}" if total and name != "ar" else "–"
        o = m["overall"]
        tall = _fmt(o["tau"]) + _fmt_ci(o.get("tau_ci")) if name not in ("ar", "hf") else "–"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_fmt(mt)} | {_fmt(ms)}× | {tall} | {ident} |")
    lines.append("")
    lines.append("tau counts the bonus token (accepted draft tokens + 1 per round); speedup is tokens/s over our "
                 "autoregressive loop (`ar`) on the same runner, prompts, dtype and threads.")
    lines.append("")
    lines.append("| method | rounds | draft ms/round | verify ms/round | total s | draft MB | " +
                 " | ".join(f"pos-acc {n}" for n in range(1, results["settings"]["depth"] + 1)) + " |")
    lines.append("|" + "---|" * (6 + results["settings"]["depth"]))
    for name, m in methods.items():
        o = m["overall"]
        pa = o["pos_acc"] if name not in ("ar", "hf") else [float("nan")] * results["settings"]["depth"]
        lines.append(f"| {name} | {o['rounds']} | {_fmt(o['draft_ms_per_round'], 1)} | "
                     f"{_fmt(o['verify_ms_per_round'], 1)} "
                     f"| {_fmt(o['seconds'], 1)} | {_fmt(m.get('draft_params_mb', float('nan')), 1)} | "
                     + " | ".join(_fmt(x) for x in pa) + " |")
    depth = results["settings"]["depth"]
    drafts = [(n, m) for n, m in methods.items() if n not in ("ar", "hf")]
    if drafts:
        lines.append("")
        lines.append("pos-acc(n) with its 95 % interval (bootstrap over questions), and the rounds that reached "
                     "position n (accepted n - 1 draft tokens): the sample behind it.")
        lines.append("")
        lines.append("| method | " + " | ".join(f"pos-acc {n} | reached {n}" for n in range(1, depth + 1)) + " |")
        lines.append("|" + "---|" * (1 + 2 * depth))
        for name, m in drafts:
            o = m["overall"]
            cis = o.get("pos_acc_ci") or [None] * depth
            reach = o.get("reached", [0] * depth)
            cells = [f"{_fmt(a)}{_fmt_ci(ci)} | {r}" for a, ci, r in zip(o["pos_acc"], cis, reach)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if results.get("comparisons"):
        lines.append("")
        lines.append("Paired differences A - B over the questions both answered, with 95 % intervals (paired "
                     "bootstrap over questions; pos-acc in points).")
        lines.append("")
        lines.append("| A - B | questions | tau | " + " | ".join(f"pos-acc {n}" for n in range(1, depth + 1)) + " |")
        lines.append("|" + "---|" * (3 + depth))
        for c in results["comparisons"]:
            d, lo, hi = c["tau"]
            acc = [f"{100 * x:+.1f}{_fmt_ci((100 * l, 100 * h), 1, True)}" if not math.isnan(x) else "–"
                   for x, l, h in c["pos_acc"]]
            lines.append(f"| {c['a']} - {c['b']} | {c['questions']} | {d:+.3f}{_fmt_ci((lo, hi), 3, True)} | "
                         + " | ".join(acc) + " |")
    mach = results["machine"]
    s = results["settings"]
    lines.append("")
    gemm = f" (GEMM: {mach['linear_kernel']})" if mach.get("linear_kernel") else ""
    lines.append(f"Machine: {mach['cpu']} ({mach['torch_cpu_capability']}), {mach['threads']} threads, {mach['dtype']}"
                 f"{gemm}, torch {mach['torch']}. Settings: {s}.")
    return "\n".join(lines) + "\n"


def plots(results: Dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafts = {n: m for n, m in results["methods"].items() if n not in ("ar", "hf")}
    depth = results["settings"]["depth"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (name, m) in enumerate(drafts.items()):
        acc = m["overall"]["pos_acc"]
        ci = m["overall"].get("pos_acc_ci")
        x = [n + 0.06 * (i - (len(drafts) - 1) / 2) for n in range(1, depth + 1)]  # side by side, not on top
        if ci:
            err = [[a - lo for a, (lo, _) in zip(acc, ci)], [hi - a for a, (_, hi) in zip(acc, ci)]]
            ax.errorbar(x, acc, yerr=err, marker="o", capsize=3, label=name)
        else:
            ax.plot(x, acc, marker="o", label=name)
    ax.set_xlabel("draft position n")
    ax.set_ylabel("pos-acc(n)")
    ax.set_title("Position-wise acceptance, 95 % intervals (all datasets)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "pos_acc.png", dpi=120)
    plt.close(fig)

    sets = sorted({ds for m in drafts.values() for ds in m["datasets"]})
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(sets) + 2), 4))
    w = 0.8 / max(len(drafts), 1)
    for i, (name, m) in enumerate(drafts.items()):
        ax.bar([x + i * w for x in range(len(sets))], [m["datasets"][ds]["tau"] if ds in m["datasets"] else 0
                                                       for ds in sets], w, label=name)
    ax.set_xticks([x + w * (len(drafts) - 1) / 2 for x in range(len(sets))], sets)
    ax.set_ylabel("tau (tokens per round, bonus counted)")
    ax.set_title("tau per dataset")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tau.png", dpi=120)
    plt.close(fig)


def write(out, depth: int, settings: Dict, threads=None, dtype="float32", make_plots: bool = True) -> Dict:
    """Read ``out/records.jsonl`` and write ``results.json`` (records included), ``table.md`` and the plots."""
    from poss.eval.run import read_done

    out = Path(out)
    records = list(read_done(out / "records.jsonl").values())
    extra = {}
    for p in out.glob("draft-*.json"):
        info = json.loads(p.read_text())
        extra[info["method"]] = {"draft_params_mb": info["draft_params_mb"]}
    results = build(records, depth, settings, threads, dtype, extra)
    results["records"] = records
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(table(results))
    if make_plots and any(n not in ("ar", "hf") for n in results["methods"]):
        plots(results, out)
    return results


__all__ = ["add_hists", "build", "mean_tau", "plots", "pos_acc", "table", "write"]
