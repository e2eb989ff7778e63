"""scripts/eval_repetition.py: the repeated n-gram share and the per-bucket tau, on hand-made records."""

import pytest

from helpers.scripts import load_script


@pytest.fixture(scope="module")
def rep():
    return load_script("eval_repetition")


def test_repeated_share_counts_ngrams_seen_earlier(rep):
    # 3-grams of 1 2 3 1 2 3 1 2: 123 231 312 are new, then 123 231 312 again -> 3 of 6
    assert rep.repeated_share([1, 2, 3, 1, 2, 3, 1, 2], 3) == 0.5
    # 2-grams of 5 5 5 5: the first 55 is new, the next two repeat it
    assert rep.repeated_share([5, 5, 5, 5], 2) == pytest.approx(2 / 3)
    assert rep.repeated_share([1, 2, 3, 4], 2) == 0.0
    assert rep.repeated_share([1, 2], 3) == 0.0


def test_by_bucket_groups_turns_and_skips_ar(rep):
    fresh, loop = list(range(20)), [7, 8] * 10  # 0 and 17 of 19 repeated 2-grams
    turns = [{"token_ids": fresh, "accept_hist": [1, 1]},  # tau (1 + 2) / 2 = 1.5
             {"token_ids": loop, "accept_hist": [0, 0, 2]}]  # tau 3
    records = [{"method": "ar", "turns": [{"token_ids": fresh, "accept_hist": [5]}]},
               {"method": "hass", "turns": turns},
               {"method": "poss2", "turns": [dict(turns[0], accept_hist=[0, 2]), turns[1]]}]  # tau 2, 3
    groups = rep.by_bucket(records, 2)
    assert set(groups) == {"hass", "poss2"}
    assert groups["hass"][0] == [1.5] and groups["hass"][2] == [3.0]
    assert groups["poss2"][0] == [2.0] and groups["poss2"][2] == [3.0]
    text = rep.table(groups, 2)
    assert "| 0% – 10% | 1 | 1.50 | 2.00 |" in text
    assert "| all | 2 | 2.25 | 2.50 |" in text
    assert "10% – 50%" not in text  # empty buckets are left out


def test_main_rejects_a_folder_without_records(rep, tmp_path):
    with pytest.raises(SystemExit):
        rep.main([str(tmp_path)])
