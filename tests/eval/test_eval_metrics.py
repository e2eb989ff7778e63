"""tau from pos-acc (``poss.eval.metrics.tau_from_pos_acc``): by hand, and equal to the histogram's tau."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poss.eval.metrics import pos_acc, tau_from_pos_acc, tau_of


def test_tau_from_pos_acc_by_hand():
    assert tau_from_pos_acc([0.5, 0.5]) == 1.75  # 1 + 1/2 + 1/4
    assert tau_from_pos_acc([]) == 1.0
    assert tau_from_pos_acc([0.0, float("nan")]) == 1.0  # nothing reaches depth 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=7).filter(sum))
def test_tau_from_pos_acc_is_the_histograms_tau(hist):
    # P(accept >= n) is the product of pos-acc(1..n): the identity tau_from_pos_acc rests on.
    assert tau_from_pos_acc(pos_acc(hist, len(hist) - 1)) == pytest.approx(tau_of(hist), rel=1e-12)


def test_nan_rate_is_not_a_number():
    assert math.isnan(pos_acc([3, 0], 2)[1])
