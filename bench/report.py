"""Turns a pytest-benchmark JSON file into the README's markdown table and a PNG plot.

    python bench/report.py out/tree_verify.json [--png out/tree_verify.png]

Ratios compare timings taken in the same run (the machine is shared and noisy).
"""

import argparse
import json
from collections import defaultdict


def load(path):
    with open(path) as f:
        data = json.load(f)
    rows = defaultdict(dict)
    for bench in data["benchmarks"]:
        info = bench["extra_info"]
        key = tuple(v for k, v in info.items() if k not in ("impl", "mean_accept_len"))
        rows[key][info["impl"]] = bench["stats"]["median"]
        rows[key]["_info"] = info
    return rows


def ms(seconds):
    return f"{seconds * 1e3:.2f}" if seconds is not None else "–"


def ratio(a, b):
    return f"{a / b:.2f}×" if a is not None and b is not None else "–"


def tree_verify_table(rows):
    lines = [
        "| B | V | dtype | argmax floor (ms) | greedy (ms) | greedy / floor | sampling (ms) | sampling / floor | reference greedy / greedy | reference sampling / sampling |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(rows, key=lambda k: (rows[k]["_info"]["V"], rows[k]["_info"]["dtype"], rows[k]["_info"]["B"])):
        r = rows[key]
        i = r["_info"]
        floor, greedy, sampling = r.get("argmax_floor"), r.get("greedy"), r.get("sampling")
        lines.append(
            f"| {i['B']} | {i['V']} | {i['dtype'].split('.')[-1]} | {ms(floor)} | {ms(greedy)} | {ratio(greedy, floor)} | "
            f"{ms(sampling)} | {ratio(sampling, floor)} | {ratio(r.get('reference_greedy'), greedy)} | "
            f"{ratio(r.get('reference_sampling'), sampling)} |"
        )
    return "\n".join(lines)


def plot(rows, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(rows, key=lambda k: (rows[k]["_info"]["V"], rows[k]["_info"]["dtype"], rows[k]["_info"]["B"]))
    labels = [f"B{rows[k]['_info']['B']}\nV{rows[k]['_info']['V'] // 1000}k\n{rows[k]['_info']['dtype'].split('.')[-1]}" for k in keys]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.28
    for j, impl in enumerate(["argmax_floor", "greedy", "sampling"]):
        ax.bar([x + (j - 1) * width for x in range(len(keys))], [rows[k].get(impl, 0) * 1e3 for k in keys], width, label=impl)
    ax.set_xticks(range(len(keys)), labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("median time (ms, log)")
    ax.set_title("tree_verify on the CPU vs a bare argmax over the same logits (N = 60)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json")
    parser.add_argument("--png")
    args = parser.parse_args()
    rows = load(args.json)
    print(tree_verify_table(rows))
    if args.png:
        plot(rows, args.png)


if __name__ == "__main__":
    main()
