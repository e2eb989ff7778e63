"""Turns a pytest-benchmark JSON file into the README's markdown table (and, for tree_verify, a PNG).

    python bench/report.py out/tree_verify.json [--png out/tree_verify.png]
    python bench/report.py out/tree_attention.json      # any other bench: one row per group

Other benches are tabulated per benchmark group: one column per `impl` parameter, and the time of
each baseline divided by the time of `poss` (how many times faster poss is).

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
    return f"{seconds * 1e3:.3g}" if seconds is not None else "–"


def ratio(a, b):
    if a is None or b is None:
        return "–"
    return "<0.01×" if a / b < 0.01 else f"{a / b:.2f}×"


def tree_verify_table(rows):
    lines = [
        "| B | V | dtype | argmax floor (ms) | greedy (ms) | greedy / floor | sampling (ms) | sampling / floor | "
        "reference greedy / greedy | reference sampling / sampling |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(rows, key=lambda k: (rows[k]["_info"]["V"], rows[k]["_info"]["dtype"], rows[k]["_info"]["B"])):
        r = rows[key]
        i = r["_info"]
        floor, greedy, sampling = r.get("argmax_floor"), r.get("greedy"), r.get("sampling")
        lines.append(
            f"| {i['B']} | {i['V']} | {i['dtype'].split('.')[-1]} | {ms(floor)} | {ms(greedy)} | "
            f"{ratio(greedy, floor)} | "
            f"{ms(sampling)} | {ratio(sampling, floor)} | {ratio(r.get('reference_greedy'), greedy)} | "
            f"{ratio(r.get('reference_sampling'), sampling)} |"
        )
    return "\n".join(lines)


def plot(rows, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(rows, key=lambda k: (rows[k]["_info"]["V"], rows[k]["_info"]["dtype"], rows[k]["_info"]["B"]))
    labels = [f"B{rows[k]['_info']['B']}\nV{rows[k]['_info']['V'] // 1000}k\n{rows[k]['_info']['dtype'].split('.')[-1]}"
              for k in keys]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.28
    for j, impl in enumerate(["argmax_floor", "greedy", "sampling"]):
        ax.bar([x + (j - 1) * width for x in range(len(keys))], [rows[k].get(impl, 0) * 1e3 for k in keys], width,
               label=impl)
    ax.set_xticks(range(len(keys)), labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("median time (ms, log)")
    ax.set_title("tree_verify on the CPU vs a bare argmax over the same logits (N = 60)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def group_tables(path):
    """One markdown table per bench family (the group name's first word)."""
    with open(path) as f:
        data = json.load(f)
    families = defaultdict(lambda: defaultdict(dict))
    for bench in data["benchmarks"]:
        impl = bench["params"].get("impl", bench["name"])
        families[bench["group"].split()[0]][bench["group"]][impl] = bench["stats"]["median"]
    tables = []
    for family, groups in families.items():
        impls = list(dict.fromkeys(i for times in groups.values() for i in times))
        primary = "poss" if "poss" in impls else impls[0]
        others = [i for i in impls if i != primary]
        head = [family] + [f"{i} (ms)" for i in impls] + [f"{o} / {primary}" for o in others]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for group, times in groups.items():
            label = group.split(" ", 1)[1] if " " in group else group
            cells = [label] + [ms(times.get(i)) for i in impls]
            cells += [ratio(times.get(o), times.get(primary)) for o in others]
            lines.append("| " + " | ".join(cells) + " |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json")
    parser.add_argument("--png")
    args = parser.parse_args()
    with open(args.json) as f:
        is_tree_verify = any(b["params"].get("impl") == "argmax_floor" for b in json.load(f)["benchmarks"])
    if not is_tree_verify:
        print(group_tables(args.json))
        return
    rows = load(args.json)
    print(tree_verify_table(rows))
    if args.png:
        plot(rows, args.png)


if __name__ == "__main__":
    main()
