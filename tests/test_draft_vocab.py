"""The reduced draft vocabulary: selection, inverse map, coverage."""

from collections import Counter

import pytest
import torch

from poss.train.draft_vocab import coverage, inverse_map, select_draft_vocab, token_counts


def test_most_frequent_ids_with_end_tokens_kept():
    counts = token_counts([[5, 5, 5, 7, 7, 9], [7, 3, 3, 3, 3]])
    assert counts == Counter({3: 4, 5: 3, 7: 3, 9: 1})
    # 3 (4x), then 5 and 7 tie at 3x: lower id first; end token 2 takes the last seat
    assert select_draft_vocab(counts, 3, 10).tolist() == [3, 5, 7]
    assert select_draft_vocab(counts, 3, 10, always=[2]).tolist() == [2, 3, 5]


def test_too_few_tokens_are_filled_to_k():
    m = select_draft_vocab(Counter({8: 2}), 4, 10)
    assert m.tolist() == [0, 1, 2, 8]
    assert select_draft_vocab(Counter({1: 1}), 50, 10).numel() == 10
    with pytest.raises(ValueError, match="draft vocabulary size"):
        select_draft_vocab(Counter(), 0, 10)


def test_inverse_map_round_trips():
    m = torch.tensor([1, 4, 6])
    inv = inverse_map(m, 8)
    assert inv.tolist() == [-1, 0, -1, -1, 1, -1, 2, -1]
    assert torch.equal(m[inv[m]], m)


def test_coverage_counts_tokens_in_the_set():
    assert coverage(torch.tensor([1, 2]), [[1, 2, 3, 4], [1]]) == pytest.approx(3 / 5)
