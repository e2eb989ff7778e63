"""One Markdown table and one PNG bar chart from a ``bench/bench_e2e.py`` JSON.

    PYTHONPATH=.:python python bench/e2e_report.py docs/bench/e2e_cpu.json --png docs/img/e2e_cpu.png
"""

import argparse
import json
import textwrap
from pathlib import Path
from typing import Dict

PROMPT_SETS = {"mt_bench": "MT-Bench", "humaneval164": "HumanEval"}  # display names of the packaged sets


def _find(rows, name):
    return next((r for r in rows if r["name"] == name), None)


def table(res: Dict) -> str:
    rows = res["rows"]
    ar = _find(rows, "our AR loop")
    hfg = _find(rows, "HF generate")
    lcp = _find(rows, "llama.cpp plain")
    prompt_set = res.get("prompt_set", "mt_bench")  # runs from before the flag: MT-Bench
    prompt_set = PROMPT_SETS.get(prompt_set, prompt_set)
    lines = [f"Machine: {res['header']}. {res['prompts']} {prompt_set} prompts x {res['new_tokens']} new tokens, "
             "batch 1, greedy." + (f" Load average {res['loadavg_start'][0]:.1f} at the start, "
                                   f"{res['loadavg_end'][0]:.1f} at the end (2 cores, shared)."
                                   if "loadavg_end" in res else "")
             + (f" {res['huge_page_mb']:.0f} MB of the process on 2 MB pages after loading."
                if "huge_page_mb" in res else ""), "",
             "| system | tree (nodes/depth) | tokens/s | x our AR | x HF generate" + (" | x llama.cpp" if lcp else "")
             + " | tau | ms per round: draft / verify / commit / host | identical to our AR |",
             "|---|---|---|---|---|---|---|---|" + ("---|" if lcp else "")]
    for r in rows:
        x_ar = f"{r['tokens_per_s'] / ar['tokens_per_s']:.2f}" if ar else ""
        x_hf = f"{r['tokens_per_s'] / hfg['tokens_per_s']:.2f}" if hfg else ""
        x_lcp = f" | {r['tokens_per_s'] / lcp['tokens_per_s']:.2f}" if lcp else ""
        tau = f"{r['tau']:.2f}" if "tau" in r else ""
        ms = r.get("round_ms") or {}
        phases = " / ".join(f"{ms.get(k, 0.0):.1f}" for k in ("draft", "verify", "commit", "host")) if ms else ""
        mark = " †" if r.get("interleaved") else ""
        lines.append(f"| {r['name']}{mark} | {r.get('tree', '')} | {r['tokens_per_s']:.1f} | {x_ar} | {x_hf}{x_lcp} "
                     f"| {tau} | {phases} | {r.get('identical_to_ar', '')} |")
    if any(r.get("interleaved") for r in rows):
        lines += ["", "† timed prompt by prompt in turn (`bench_e2e.interleaved`): their ratios are the "
                  "run's fair comparison; the other rows ran one after another, at other moments of the run."]
    if any(r.get("extra_bufts") is False for r in rows):
        lines += ["", "llama.cpp ran without its extra weight buffers (repacked / AMX layouts): with them its first "
                  "decode crashed on this CPU (`bench_e2e.llama_extra_bufts_work`)."]
    measured = [r for r in rows if "bandwidth" in r]
    if measured:
        lines.append("")
    for r in measured:  # our AR loop, and again on 4 KB pages where the run has that row
        bw = r["bandwidth"]
        lines.append(f"{r['name'][0].upper() + r['name'][1:]} streams {bw['weight_bytes'] / 1e6:.0f} MB of weights per "
                     f"step: {bw['achieved_gbs']:.1f} GB/s achieved against {res['read_bandwidth_gbs']:.1f} GB/s "
                     f"measured read bandwidth ({100 * bw['achieved_gbs'] / res['read_bandwidth_gbs']:.0f}% of "
                     "the roofline).")
    for name, a in res.get("auto", {}).items():
        cal = a.get("calibration")
        extra = ""
        if cal:
            extra = (f" (fitted s={cal['s']}, beta={cal['beta']}; calibration "
                     f"{a.get('calibration_seconds', 0):.0f} s, cached)")
        lines.append(f"- `{name}`: auto picked {a['tree']}{extra}")
    return "\n".join(lines)


def chart(res: Dict, png) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    colors = {"ours": "tab:blue", "draft": "tab:green", "hf": "tab:orange", "llama.cpp": "tab:red"}
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
    names = [r["name"] for r in rows][::-1]
    vals = [r["tokens_per_s"] for r in rows][::-1]
    ax.barh(names, vals, color=[colors.get(r["kind"], "gray") for r in rows][::-1])
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.1f}", va="center", fontsize=8)
    ax.set_xlabel("tokens/s (greedy; batch 1 unless the row names a batch)")
    # The machine header is long: wrapped, it stays inside the figure beside the long row labels.
    ax.set_title("\n".join(textwrap.wrap(res["header"], 70)), fontsize=8)
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--png")
    args = ap.parse_args(argv)
    res = json.loads(Path(args.json).read_text())
    print(table(res))
    if args.png:
        chart(res, args.png)


if __name__ == "__main__":
    main()
