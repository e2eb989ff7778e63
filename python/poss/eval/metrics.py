"""The speculative-decoding metrics of the PosS paper, from per-turn accept histograms.

``accept_hist[a]`` counts the verify rounds that accepted ``a`` draft tokens (so each such round
produced ``a + 1`` tokens: the accepted ones plus the target's bonus token).

- **tau** (mean acceptance length, bonus token counted): per question, the mean over its rounds of
  ``a + 1``; then the mean over questions.
- **pos-acc(n)**: among rounds that accepted at least ``n - 1`` draft tokens, the share that
  accepted at least ``n``; pooled over the rounds of a dataset (or of all datasets).
- **reached(n)**: the rounds that tried position n (accepted at least ``n - 1``): the sample size
  behind pos-acc(n), small deep in the tree when acceptance is low.
- **speedup**: a method's tokens per second over the autoregressive loop's, on the same prompts.

95 % intervals for tau and pos-acc (a bootstrap over questions) are in :mod:`poss.eval.intervals`.
"""

from typing import Dict, List, Sequence


def add_hists(hists: Sequence[Sequence[int]]) -> List[int]:
    """Element-wise sum of histograms of possibly different lengths."""
    n = max((len(h) for h in hists), default=0)
    out = [0] * n
    for h in hists:
        for a, c in enumerate(h):
            out[a] += c
    return out


def tau_of(hist: Sequence[int]) -> float:
    """Mean tokens per round (accepted + 1) of one histogram; NaN without rounds."""
    rounds = sum(hist)
    return sum((a + 1) * c for a, c in enumerate(hist)) / rounds if rounds else float("nan")


def mean_tau(question_hists: Sequence[Sequence[int]]) -> float:
    """tau averaged over questions (each question's rounds pooled over its turns first)."""
    taus = [tau_of(h) for h in question_hists if sum(h)]
    return sum(taus) / len(taus) if taus else float("nan")


def pos_acc(hist: Sequence[int], depth: int) -> List[float]:
    """``[pos-acc(1), ..., pos-acc(depth)]``; NaN where no round reached ``n - 1``."""
    out = []
    for n in range(1, depth + 1):
        reached = sum(hist[n - 1:])
        out.append(sum(hist[n:]) / reached if reached else float("nan"))
    return out


def reached(hist: Sequence[int], depth: int) -> List[int]:
    """``[reached(1), ..., reached(depth)]``: rounds that accepted at least ``n - 1`` draft tokens."""
    return [sum(hist[n - 1:]) for n in range(1, depth + 1)]


def tau_from_pos_acc(acc: Sequence[float]) -> float:
    """The tau that per-depth acceptance rates imply: ``1 + sum_n prod_{i <= n} acc[i - 1]``.

    A round accepts at least ``n`` draft tokens with probability ``prod_{i <= n} pos-acc(i)``, and
    tau is 1 plus the sum of those probabilities, so for one histogram ``tau_from_pos_acc(pos_acc(h,
    depth))`` is ``tau_of(h)`` (pooled over its rounds) when no round accepts more than ``depth``. A NaN
    rate (no round reached that depth) ends the sum: nothing gets past it. This is how a change of
    pos-acc at some depths translates into tau."""
    total, reach = 1.0, 1.0
    for a in acc:
        if a != a:  # NaN
            break
        reach *= a
        total += reach
    return total


def speedup(tokens: int, seconds: float, base_tokens: int, base_seconds: float) -> float:
    """Throughput ratio ``(tokens / seconds) / (base_tokens / base_seconds)``."""
    if seconds <= 0 or base_tokens <= 0 or base_seconds <= 0:
        return float("nan")
    return (tokens / seconds) / (base_tokens / base_seconds)


def question_hists(questions: Sequence[Dict]) -> List[List[int]]:
    """Each question's accept histogram, its turns pooled."""
    return [add_hists([t["accept_hist"] for t in q["turns"]]) for q in questions]


def summarize(questions: Sequence[Dict], depth: int, intervals: bool = True) -> Dict:
    """Aggregate of one method on one dataset. Each question is ``{"turns": [turn, ...]}`` with a
    turn ``{"tokens", "seconds", "accept_hist", "draft_s", "verify_s", "commit_s"}``. With
    ``intervals``, ``tau_ci`` and ``pos_acc_ci`` hold 95 % bootstrap intervals over the questions."""
    turns = [t for q in questions for t in q["turns"]]
    qh = question_hists(questions)
    hist = add_hists(qh)
    rounds = sum(hist)
    secs = sum(t["seconds"] for t in turns)
    ci = {}
    if intervals and rounds:
        from poss.eval.intervals import bootstrap

        b = bootstrap(qh, depth)
        ci = {"tau_ci": list(b["tau"]), "pos_acc_ci": [list(x) for x in b["pos_acc"]]}
    return {**ci, "questions": len(questions), "turns": len(turns), "tokens": sum(t["tokens"] for t in turns),
            "seconds": secs, "rounds": rounds, "tau": mean_tau(qh), "accept_hist": hist,
            "pos_acc": pos_acc(hist, depth), "reached": reached(hist, depth),
            "draft_ms_per_round": 1e3 * sum(t.get("draft_s", 0.0) for t in turns) / max(rounds, 1),
            "verify_ms_per_round": 1e3 * sum(t.get("verify_s", 0.0) for t in turns) / max(rounds, 1),
            "commit_ms_per_round": 1e3 * sum(t.get("commit_s", 0.0) for t in turns) / max(rounds, 1)}
