"""scripts/val_acc_by_length.py: the answer-prefix examples and the records reader, on hand-made records."""

import json
import lzma

import pytest

from helpers.scripts import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("val_acc_by_length")


RECORD = {"key": 1000000000, "split": "val", "prompt_ids": [10, 11, 12], "answer_ids": [20, 21, 22, 23, 24]}


def test_whole_answers_match_the_training_loader(script):
    # poss.train.distill.load_keyed_examples: ids = (prompt + answer)[:-1], the answer positions masked in
    (ex,) = script.examples([RECORD], 0)
    assert ex.input_ids.tolist() == [10, 11, 12, 20, 21, 22, 23]
    assert ex.loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 1]


def test_a_prefix_scores_only_its_first_answer_tokens(script):
    # The first 2 + 1 answer tokens laid out as the training loader lays out a whole answer.
    (ex,) = script.examples([RECORD], 2)
    assert ex.input_ids.tolist() == [10, 11, 12, 20, 21]
    assert ex.loss_mask.tolist() == [0, 0, 0, 1, 1]
    # A prefix longer than the answer is the whole answer.
    (long,) = script.examples([RECORD], 50)
    assert long.input_ids.tolist() == script.examples([RECORD], 0)[0].input_ids.tolist()


def test_reads_plain_and_xz_records(script, tmp_path):
    lines = "".join(json.dumps(r) + "\n" for r in (RECORD, dict(RECORD, key=0, split="train")))
    (tmp_path / "records.jsonl").write_text(lines)
    with lzma.open(tmp_path / "records.jsonl.xz", "wt") as f:
        f.write(lines)
    for name in ("records.jsonl", "records.jsonl.xz"):
        got = script.read_records(tmp_path / name)
        assert [r["split"] for r in got] == ["val", "train"] and got[0] == RECORD
