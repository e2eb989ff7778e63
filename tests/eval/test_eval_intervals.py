"""Bootstrap intervals of tau and pos-acc, checked against the metrics' own definitions."""

import math

import numpy as np
import pytest

from poss.eval.intervals import bootstrap, paired_difference
from poss.eval.metrics import add_hists, mean_tau, pos_acc, reached, summarize


def random_hists(rng, n_questions, depth, p_accept):
    """Questions of 1-30 rounds each; a round accepts a geometric number of tokens, capped at ``depth``."""
    out = []
    for _ in range(n_questions):
        h = [0] * (depth + 1)
        for _ in range(rng.integers(1, 31)):
            a = 0
            while a < depth and rng.random() < p_accept:
                a += 1
            h[a] += 1
        out.append(h)
    return out


def test_bootstrap_matches_the_metrics_on_the_same_resamples():
    rng = np.random.default_rng(1)
    hists, depth, reps, seed = random_hists(rng, 25, 4, 0.6), 4, 300, 7
    got = bootstrap(hists, depth, replicates=reps, seed=seed)
    idx = np.random.default_rng(seed).integers(0, len(hists), size=(reps, len(hists)))
    taus = [mean_tau([hists[i] for i in row]) for row in idx]
    accs = np.array([pos_acc(add_hists([hists[i] for i in row]), depth) for row in idx])
    assert got["tau"] == pytest.approx((np.percentile(taus, 2.5), np.percentile(taus, 97.5)), rel=1e-12)
    for n in range(depth):
        want = (np.nanpercentile(accs[:, n], 2.5), np.nanpercentile(accs[:, n], 97.5))
        assert got["pos_acc"][n] == pytest.approx(want, rel=1e-12)


def test_identical_questions_give_a_point_interval():
    h = [2, 1, 3]
    got = bootstrap([h] * 10, depth=2)
    assert got["tau"] == pytest.approx((mean_tau([h]),) * 2)
    assert got["pos_acc"] == [pytest.approx((v, v)) for v in pos_acc(h, 2)]


def test_depth_never_reached_gives_nan():
    got = bootstrap([[3, 0], [2, 0]], depth=3)
    assert all(math.isnan(v) for v in got["pos_acc"][1]) and all(math.isnan(v) for v in got["pos_acc"][2])


def test_tau_interval_covers_the_true_mean_about_95_percent_of_the_time():
    # One round per question, so a question's tau is a + 1 and the population mean is known exactly.
    probs = np.array([0.3, 0.25, 0.2, 0.15, 0.1])
    true = float((probs * np.arange(1, 6)).sum())
    rng = np.random.default_rng(3)
    covered, trials = 0, 200
    for t in range(trials):
        draws = rng.choice(5, size=60, p=probs)
        hists = [[int(a == k) for k in range(5)] for a in draws]
        lo, hi = bootstrap(hists, depth=4, replicates=500, seed=t)["tau"]
        covered += lo <= true <= hi
    assert 0.88 <= covered / trials <= 0.99


def test_paired_difference_of_a_method_with_itself_is_zero():
    hists = random_hists(np.random.default_rng(2), 20, 3, 0.5)
    d = paired_difference(hists, hists, 3)
    assert d["tau"] == (0.0, 0.0, 0.0)
    assert all(x == (0.0, 0.0, 0.0) for x in d["pos_acc"])


def test_paired_difference_of_a_uniform_shift_is_exact():
    # A accepts one more token than B in every round of every question: tau differs by exactly 1.
    rng = np.random.default_rng(4)
    b = random_hists(rng, 15, 3, 0.5)
    b = [h[:3] + [0] for h in b]  # B never accepts 3, so the shift stays within depth 3
    a = [[0] + h[:3] for h in b]
    d = paired_difference(a, b, 3)
    assert d["tau"] == pytest.approx((1.0, 1.0, 1.0))
    assert d["pos_acc"][0][0] == pytest.approx(1.0 - pos_acc(add_hists(b), 3)[0])  # A always accepts position 1


def test_paired_difference_is_tighter_than_separate_intervals():
    rng = np.random.default_rng(5)
    b = random_hists(rng, 40, 4, 0.6)
    a = [[max(c - (k == 0), 0) for k, c in enumerate(h)] for h in b]  # A loses one zero-accept round
    d = paired_difference(a, b, 4)
    sep_a, sep_b = bootstrap(a, 4)["tau"], bootstrap(b, 4)["tau"]
    assert d["tau"][0] > 0 and d["tau"][1] > 0  # the paired interval sees the small, consistent gain
    assert sep_a[0] < sep_b[1]  # while the two separate intervals overlap


def test_paired_difference_needs_the_same_questions():
    with pytest.raises(ValueError, match="paired questions"):
        paired_difference([[1]], [[1], [2]], 1)


def test_summarize_reports_reached_and_intervals():
    q = [{"turns": [{"tokens": 4, "seconds": 1.0, "accept_hist": [1, 2, 1]}]},
         {"turns": [{"tokens": 2, "seconds": 1.0, "accept_hist": [2]}]}]
    s = summarize(q, depth=2)
    assert s["reached"] == reached([3, 2, 1], 2) == [6, 3]
    lo, hi = s["tau_ci"]
    assert lo <= s["tau"] <= hi
    assert len(s["pos_acc_ci"]) == 2
