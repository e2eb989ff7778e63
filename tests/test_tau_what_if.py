"""tau from pos-acc (poss.eval.metrics.tau_from_pos_acc) and scripts/tau_what_if.py's counterfactuals."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.scripts import load_script
from poss.eval.metrics import mean_tau, pos_acc, tau_from_pos_acc, tau_of


@pytest.fixture(scope="module")
def tw():
    return load_script("tau_what_if")


def test_tau_from_pos_acc_by_hand():
    assert tau_from_pos_acc([0.5, 0.5]) == 1.75  # 1 + 1/2 + 1/4
    assert tau_from_pos_acc([]) == 1.0
    assert tau_from_pos_acc([0.0, float("nan")]) == 1.0  # nothing reaches depth 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=7).filter(sum))
def test_tau_from_pos_acc_is_the_histograms_tau(hist):
    # P(accept >= n) is the product of pos-acc(1..n): the identity the script's counterfactuals rest on.
    assert tau_from_pos_acc(pos_acc(hist, len(hist) - 1)) == pytest.approx(tau_of(hist), rel=1e-12)


def records(method, hists):
    # One turn per question; the script pools a question's turns, so split one question over two turns.
    out = [{"method": method, "draft": f"drafts/{method}", "question_id": i,
            "turns": [{"accept_hist": h}]} for i, h in enumerate(hists)]
    out[0]["turns"] = [{"accept_hist": hists[0][:1]}, {"accept_hist": [0] + list(hists[0][1:])}]
    return out


def test_counterfactuals_by_hand(tw):
    # One question, depth 2, hist [1, 1, 2]: pos-acc 3/4 and 2/3, tau (1 + 2 + 3 + 3) / 4 = 2.25.
    rates = tw.question_rates(records("a", [[1, 1, 2]]), "a", 2)
    assert rates == [[0.75, pytest.approx(2 / 3)]]
    assert tw.tau_raised(rates) == pytest.approx(2.25)
    assert tw.tau_raised(rates, [2], 0.1) == pytest.approx(1 + 0.75 + 0.75 * (2 / 3 + 0.1))
    assert tw.tau_raised(rates, [1, 2], 1.0) == pytest.approx(3.0)  # capped at 1: every round accepts both
    # tau = 1 + p1 (1 + 2/3), so tau 2.5 needs p1 = 0.9: +15 points at depth 1.
    assert tw.points_needed(rates, [1], 2.5) == pytest.approx(15.0, abs=1e-6)
    assert tw.points_needed(rates, [1], 2.0) == 0.0
    assert tw.points_needed(rates, [1, 2], 3.5) is None  # above depth + 1


def test_report_keeps_each_questions_tau_and_fills_unreached_depths(tw):
    hists = [[1, 1, 2], [3, 1], [4]]  # the last two never reach depth 2; the last not even depth 1
    recs = records("a", hists) + records("b", [[0, 0, 4]])
    res = tw.report(recs, ["a"], 2, [2], 0.0, 1.05, against="b")["a"]
    assert res["questions"] == 3
    assert res["tau"] == pytest.approx(mean_tau(hists))  # metrics' own per-question mean
    assert res["raised_tau"] == pytest.approx(res["tau"])
    assert res["goal_tau"] == pytest.approx(1.05 * 3.0)
    # The second question reached depth 1 and never got past it (rate 0 at depth 2); the third never
    # reached depth 1, so its depth-2 rate is the pooled one over [8, 2, 2]: 2 / 4.
    rates = tw.question_rates(recs, "a", 2)
    assert rates == [[0.75, pytest.approx(2 / 3)], [0.25, 0.0], [0.0, 0.5]]
    assert tw.tau_raised(rates, [1], 0.25) == pytest.approx(((1 + 1 + 2 / 3) + (1 + 0.5) + (1 + 0.25 + 0.25 * 0.5)) / 3)


def test_cli(tw, tmp_path, capsys):
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records("poss2", [[1, 1, 2, 3], [2, 2, 1, 1]])
                              + records("hass", [[2, 2, 2, 1]]) + [{"method": "ar", "draft": None,
                                                                     "question_id": 0, "turns": []}]))
    out = tmp_path / "w.json"
    assert tw.main([str(path), "--depth", "3", "--raise", "3", "--against", "hass", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| hass |" in table and "| poss2 |" in table and "| ar |" not in table
    got = json.loads(out.read_text())
    assert got["methods"]["poss2"]["tau"] == pytest.approx(mean_tau([[1, 1, 2, 3], [2, 2, 1, 1]]))
    assert got["methods"]["poss2"]["raised_ratio"] > 1.0
    with pytest.raises(SystemExit):
        tw.main([str(path), "--depth", "3", "--raise", "4"])
    assert "--raise" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="accepted more than 2"):
        tw.main([str(path), "--depth", "2", "--raise", "1"])
    with pytest.raises(SystemExit, match="no records of method 'x'"):
        tw.main([str(path), "--methods", "x", "--depth", "3", "--raise", "1"])


def test_nan_rate_is_not_a_number():
    assert math.isnan(pos_acc([3, 0], 2)[1])
