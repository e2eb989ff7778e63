"""95 % intervals for tau and pos-acc: a percentile bootstrap over questions.

Questions are the unit that varies between benchmark draws (rounds within a question are not
independent: one easy prompt yields many long rounds), so every replicate resamples whole questions
with replacement and recomputes the metric exactly as :mod:`poss.eval.metrics` defines it: tau as the
mean of per-question tau, pos-acc pooled over the replicate's rounds. A difference between two methods
resamples the same questions for both (a paired bootstrap), which is far tighter than two separate
intervals when the methods answer the same prompts.
"""

from typing import Dict, List, Sequence, Tuple

import numpy as np

DEFAULT_REPLICATES = 2000


def _matrix(question_hists: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """(questions, width) int64: each accept histogram zero-padded or cut to ``width`` bins (the last bin
    pools every longer acceptance, which pos-acc up to ``width - 1`` does not distinguish)."""
    m = np.zeros((len(question_hists), width), dtype=np.int64)
    for i, h in enumerate(question_hists):
        h = list(h)
        if len(h) > width:
            h = h[:width - 1] + [sum(h[width - 1:])]
        m[i, :len(h)] = h
    return m


def _tau(hists: np.ndarray) -> np.ndarray:
    """Per-question tau of a (..., width) histogram array; NaN for a question without rounds."""
    rounds = hists.sum(-1)
    tokens = (hists * np.arange(1, hists.shape[-1] + 1)).sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(rounds > 0, tokens / np.maximum(rounds, 1), np.nan)


def _pos_acc(pooled: np.ndarray, depth: int) -> np.ndarray:
    """(..., depth) pos-acc of pooled (..., width) histograms; NaN where no round reached the depth."""
    tail = np.flip(np.cumsum(np.flip(pooled, -1), -1), -1)  # tail[..., k] = rounds accepting >= k
    reached, passed = tail[..., :depth], tail[..., 1:depth + 1]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(reached > 0, passed / np.maximum(reached, 1), np.nan)


def _replicates(hists: np.ndarray, idx: np.ndarray, depth: int) -> Tuple[np.ndarray, np.ndarray]:
    """(tau, pos_acc) of each replicate: ``idx`` (B, Q) question indices into ``hists`` (Q, width)."""
    taus = _tau(hists)
    with np.errstate(invalid="ignore"):
        tau = np.nanmean(taus[idx], axis=1)  # questions without rounds leave the mean, as in mean_tau
    pooled = hists[idx].sum(axis=1)
    return tau, _pos_acc(pooled, depth)


def _interval(samples: np.ndarray, level: float) -> List[Tuple[float, float]]:
    """Percentile interval per column of (B, ...) samples; NaN columns give (nan, nan)."""
    lo, hi = 50 * (1 - level), 50 * (1 + level)
    with np.errstate(invalid="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: no round reached that depth
            a, b = np.nanpercentile(samples, lo, axis=0), np.nanpercentile(samples, hi, axis=0)
    return [(float(x), float(y)) for x, y in zip(np.atleast_1d(a), np.atleast_1d(b))]


def _indices(n_questions: int, replicates: int, seed: int) -> np.ndarray:
    if n_questions < 1:
        raise ValueError("a bootstrap needs at least one question")
    if replicates < 1:
        raise ValueError(f"replicates must be >= 1, got {replicates}")
    return np.random.default_rng(seed).integers(0, n_questions, size=(replicates, n_questions))


def bootstrap(question_hists: Sequence[Sequence[int]], depth: int, level: float = 0.95,
              replicates: int = DEFAULT_REPLICATES, seed: int = 0) -> Dict:
    """``{"tau": (lo, hi), "pos_acc": [(lo, hi)] * depth}``: percentile intervals at ``level`` over
    ``replicates`` resamples of the questions (each question's accept histogram, turns pooled)."""
    hists = _matrix(question_hists, depth + 1)
    tau, acc = _replicates(hists, _indices(len(hists), replicates, seed), depth)
    return {"tau": _interval(tau, level)[0], "pos_acc": _interval(acc, level)}


def paired_difference(hists_a: Sequence[Sequence[int]], hists_b: Sequence[Sequence[int]], depth: int,
                      level: float = 0.95, replicates: int = DEFAULT_REPLICATES, seed: int = 0) -> Dict:
    """Method A minus method B on the same questions (``hists_a[i]`` and ``hists_b[i]`` answer question
    i): ``{"tau": (diff, lo, hi), "pos_acc": [(diff, lo, hi)] * depth}``, each difference with its paired
    percentile interval."""
    if len(hists_a) != len(hists_b):
        raise ValueError(f"paired questions: {len(hists_a)} histograms for A, {len(hists_b)} for B")
    a, b = _matrix(hists_a, depth + 1), _matrix(hists_b, depth + 1)
    idx = _indices(len(a), replicates, seed)
    ta, pa = _replicates(a, idx, depth)
    tb, pb = _replicates(b, idx, depth)
    everyone = np.arange(len(a))[None, :]
    (ta0,), (pa0,) = _replicates(a, everyone, depth)
    (tb0,), (pb0,) = _replicates(b, everyone, depth)
    tau_ci = _interval(ta - tb, level)[0]
    acc_ci = _interval(pa - pb, level)
    return {"tau": (float(ta0 - tb0), *tau_ci),
            "pos_acc": [(float(d), lo, hi) for d, (lo, hi) in zip(pa0 - pb0, acc_ci)]}
