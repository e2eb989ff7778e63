"""tau against how much an answer repeats itself, from a ``poss eval`` folder's ``records.jsonl``.

    python scripts/eval_repetition.py runs/eval-mtb512 --n 4 --out docs/bench/eval_mt_bench_512_r4/repetition.md

Long greedy answers of a small model fall into loops, and a loop is easy to draft, so tau rises with
answer length for a reason that has nothing to do with the draft. This splits the turns by the share
of their answer's n-grams that already occurred earlier in the same answer, and gives each method's
tau per group. Greedy speculation is lossless, so every method answered with the same tokens and the
groups hold the same turns for every method.
"""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Sequence

BUCKETS = ((0.0, 0.1), (0.1, 0.5), (0.5, 1.01))  # repeated share: [lo, hi)


def repeated_share(ids: Sequence[int], n: int) -> float:
    """Share of the answer's n-grams (positions ``n-1 ..``) already seen earlier in it; 0 for fewer than n tokens."""
    seen, repeats, total = set(), 0, 0
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i: i + n])
        repeats += gram in seen
        total += 1
        seen.add(gram)
    return repeats / total if total else 0.0


def turn_tau(turn: dict) -> float:
    from poss.eval.metrics import tau_of

    return tau_of(turn["accept_hist"])


def by_bucket(records: List[dict], n: int) -> Dict[str, Dict[int, List[float]]]:
    """method -> bucket index -> per-turn tau values (methods without a draft are left out)."""
    out: Dict[str, Dict[int, List[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r["method"] in ("ar", "hf"):
            continue
        for t in r["turns"]:
            share = repeated_share(t["token_ids"], n)
            b = next(i for i, (lo, hi) in enumerate(BUCKETS) if lo <= share < hi)
            out[r["method"]][b].append(turn_tau(t))
    return out


def table(groups: Dict[str, Dict[int, List[float]]], n: int) -> str:
    methods = sorted(groups)
    head = ["repeated " + str(n) + "-grams in the answer", "turns"] + [f"{m} tau" for m in methods]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b, (lo, hi) in enumerate(BUCKETS):
        counts = {len(groups[m][b]) for m in methods}
        if counts == {0}:
            continue
        label = f"{lo:.0%} – {min(hi, 1.0):.0%}" + (" (incl.)" if hi > 1 else "")
        cells = [f"{sum(groups[m][b]) / len(groups[m][b]):.2f}" if groups[m][b] else "–" for m in methods]
        lines.append(f"| {label} | {'/'.join(str(c) for c in sorted(counts))} | " + " | ".join(cells) + " |")
    allc = [sum(len(v) for v in groups[m].values()) for m in methods]
    alls = [sum(sum(v) for v in groups[m].values()) / c if c else float("nan") for m, c in zip(methods, allc)]
    lines.append(f"| all | {'/'.join(str(c) for c in sorted(set(allc)))} | " + " | ".join(f"{x:.2f}" for x in alls)
                 + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="a poss eval --out folder (holds records.jsonl)")
    ap.add_argument("--n", type=int, default=4, help="n-gram length (default 4)")
    ap.add_argument("--out", default=None, help="also write the table to this Markdown file")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error(f"--n: expected a positive n-gram length, got {args.n}")
    path = Path(args.folder) / "records.jsonl"
    if not path.is_file():
        ap.error(f"folder: no records.jsonl in {args.folder!r} (expected a poss eval --out folder)")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    text = ("Per-turn tau (mean over turns, bonus token counted) by the share of the answer's "
            f"{args.n}-grams already seen earlier in the same answer.\n\n" + table(by_bucket(records, args.n), args.n))
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
