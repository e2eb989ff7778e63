"""What a change of pos-acc at some draft depths is worth in tau, from a `poss eval` run's records.

tau is 1 + the sum over n of P(a round accepts >= n draft tokens), and that probability is the
product of pos-acc(1..n) (``poss.eval.metrics.tau_from_pos_acc``). So from each question's accept
histogram this recomputes tau with pos-acc raised by a few points at chosen depths (the PosS bar:
+3 points at depths 4-6), and finds how many points at one depth alone, or at every depth, a
method would need to multiply its tau by a ratio (the bars' 1.05). Each question keeps its own rates
(the mean over questions stays the paper's tau); a rate is capped at 1, and a depth a question never
reached takes the method's pooled rate there (it only matters once a raise makes it reachable).

    python scripts/tau_what_if.py docs/bench/eval_mt_bench_r8/trained_results.json.xz --raise 4 5 6 --by 3
"""

import argparse
import json
import lzma
import math
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT / "python"),) if p not in sys.path]  # this checkout's poss, installed or not

from poss.eval.metrics import add_hists, pos_acc, tau_from_pos_acc  # noqa: E402


def read_eval(path: Path) -> Tuple[List[dict], dict]:
    """The records and settings of an eval: ``results.json`` (its ``records``) or ``records.jsonl`` (no
    settings), either maybe ``.xz``."""
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt") as f:
        if ".jsonl" in path.name:
            return [json.loads(line) for line in f if line.strip()], {}
        data = json.load(f)
    if "records" not in data:
        raise SystemExit(f"{path}: no 'records' in this results file (pass the eval's records.jsonl)")
    return data["records"], data.get("settings", {})


def question_rates(records: Sequence[dict], method: str, depth: int) -> List[List[float]]:
    """Each question's pos-acc(1..depth) for ``method``, its turns pooled; a depth the question never
    reached takes the method's pooled rate (its chance to be reached is 0 until a raise lifts it)."""
    hists = [add_hists([t["accept_hist"] for t in r["turns"]]) for r in records if r["method"] == method]
    if not hists:
        raise SystemExit(f"no records of method {method!r}")
    if max(len(h) for h in hists) > depth + 1:
        raise SystemExit(f"{method} accepted more than {depth} draft tokens in a round: pass --depth")
    pooled = pos_acc(add_hists(hists), depth)
    return [[p if p == p else pooled[n] for n, p in enumerate(pos_acc(h, depth))] for h in hists if sum(h)]


def tau_raised(rates: Sequence[Sequence[float]], raise_at: Sequence[int] = (), by: float = 0.0) -> float:
    """tau over questions with ``by`` added to pos-acc at the 1-based depths ``raise_at`` (capped at 1)."""
    def raised(r):
        return [min(1.0, p + by) if n + 1 in raise_at else p for n, p in enumerate(r)]
    return sum(tau_from_pos_acc(raised(r)) for r in rates) / len(rates)


def points_needed(rates, raise_at: Sequence[int], goal: float) -> Optional[float]:
    """The smallest raise, in points, at ``raise_at`` that lifts tau to ``goal`` (0 when it is there
    already); None if even rates of 1 there do not."""
    if tau_raised(rates) >= goal:
        return 0.0
    if tau_raised(rates, raise_at, 1.0) < goal:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):  # tau rises with the raise: bisect to well under 0.01 points
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if tau_raised(rates, raise_at, mid) >= goal else (mid, hi)
    return 100 * hi


def report(records: Sequence[dict], methods: Sequence[str], depth: int, raise_at: Sequence[int], by_points: float,
           ratio: float, against: Optional[str] = None) -> Dict[str, Dict]:
    """Per method: its tau, its tau with ``by_points`` more pos-acc at ``raise_at``, and the points it
    needs at each depth alone and at every depth for ``ratio`` times the tau of ``against`` (else its own)."""
    out = {}
    ref = tau_raised(question_rates(records, against, depth)) if against else None
    for m in methods:
        rates = question_rates(records, m, depth)
        base = tau_raised(rates)
        raised = tau_raised(rates, raise_at, by_points / 100)
        goal = ratio * (ref if against else base)
        out[m] = {"questions": len(rates), "tau": base, "raised_tau": raised, "raised_ratio": raised / base,
                  "goal_tau": goal, "needed_at_depth": [points_needed(rates, [n], goal) for n in range(1, depth + 1)],
                  "needed_everywhere": points_needed(rates, list(range(1, depth + 1)), goal)}
    return out


def markdown(res: Dict[str, Dict], depth: int, raise_at: Sequence[int], by_points: float, ratio: float,
             against: Optional[str] = None) -> str:
    def pts(x):
        return "out of reach" if x is None else f"+{x:.1f}"
    at = "/".join(map(str, raise_at))
    whose = f"{against}'s" if against else "its own"
    depths = " / ".join(map(str, range(1, depth + 1)))
    head = (f"| method | questions | tau | tau with +{by_points:g} points at depths {at} | × | "
            f"goal: {ratio:g}× {whose} tau | points for it at depth {depths} alone | at every depth |")
    lines = [head, "|" + "---|" * 8]
    for m, r in res.items():
        lines.append(f"| {m} | {r['questions']} | {r['tau']:.3f} | {r['raised_tau']:.3f} | {r['raised_ratio']:.4f} | "
                     f"{r['goal_tau']:.3f} | "
                     + " / ".join(pts(x) for x in r["needed_at_depth"]) + f" | {pts(r['needed_everywhere'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="a `poss eval` results.json or records.jsonl (maybe .xz)")
    ap.add_argument("--methods", nargs="*", default=None, help="draft methods to report (default: every draft in it)")
    ap.add_argument("--depth", type=int, default=None, help="the tree depth (default: the eval's settings, else 6)")
    ap.add_argument("--raise", dest="raise_at", type=int, nargs="+", default=[4, 5, 6],
                    help="1-based depths whose pos-acc is raised")
    ap.add_argument("--by", type=float, default=3.0, help="the raise, in percentage points")
    ap.add_argument("--ratio", type=float, default=1.05, help="the tau ratio to find the needed raise for")
    ap.add_argument("--against", default=None,
                    help="the method whose tau the ratio multiplies (the bar tau(PosS) >= 1.05 x tau(HASS): hass); "
                         "default: each method's own")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    a = ap.parse_args(argv)
    if not a.results.is_file():
        ap.error(f"results: no such file {str(a.results)!r}")
    records, settings = read_eval(a.results)
    depth = a.depth or settings.get("depth", 6)
    if depth < 1 or any(not 1 <= n <= depth for n in a.raise_at):
        ap.error(f"--raise: expected depths in [1, {depth}], got {a.raise_at}")
    if not (math.isfinite(a.by) and 0 <= a.by <= 100) or not (math.isfinite(a.ratio) and a.ratio >= 1):
        ap.error(f"--by must be in [0, 100] points and --ratio >= 1, got {a.by} and {a.ratio}")
    methods = a.methods or sorted({r["method"] for r in records if r.get("draft")})
    res = report(records, methods, depth, a.raise_at, a.by, a.ratio, a.against)
    print(markdown(res, depth, a.raise_at, a.by, a.ratio, a.against))
    if a.json:
        a.json.write_text(json.dumps({"source": str(a.results), "depth": depth, "raise": a.raise_at, "by": a.by,
                                      "ratio": a.ratio, "against": a.against, "methods": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
