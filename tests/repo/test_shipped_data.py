"""The on-policy training data shipped in data/distill-*/ is what each data card says:
the file's sha256 (compressed and not), the split sizes, the answer-token counts, the truncation
flags, and well-formed records (unique keys, token ids inside the target's vocabulary)."""

import hashlib
import json
import lzma
import re
from pathlib import Path

import pytest

SETS = sorted((Path(__file__).resolve().parents[2] / "data").glob("distill-*"))
VOCABS = {"distill-smollm2-135m": 49152, "distill-qwen2.5-coder-0.5b": 151936}  # each target's vocabulary


def vocab_of(folder: Path) -> int:
    return next(v for prefix, v in VOCABS.items() if folder.name.startswith(prefix))


def card_number(card: str, label: str) -> int:
    m = re.search(rf"\| {label} \| ([\d,]+)", card)
    assert m, f"the data card has no '{label}' row"
    return int(m.group(1).replace(",", ""))


def test_the_data_sets_are_there():
    assert [d.name for d in SETS if d.name.startswith("distill-smollm2-135m")]


@pytest.fixture(scope="module", params=SETS, ids=[d.name for d in SETS])
def shipped(request):
    DATA = request.param
    card = (DATA / "README.md").read_text()
    packed = (DATA / "records.jsonl.xz").read_bytes()
    raw = lzma.decompress(packed)
    records = [json.loads(line) for line in raw.decode().splitlines()]
    return card, packed, raw, records, DATA


def test_checksums_match_the_card(shipped):
    card, packed, raw, _, _ = shipped
    want_packed, want_raw = re.search(r"sha256 `([0-9a-f]{64})` \(uncompressed `([0-9a-f]{64})`\)", card).groups()
    assert hashlib.sha256(packed).hexdigest() == want_packed
    assert hashlib.sha256(raw).hexdigest() == want_raw


def test_counts_match_the_card(shipped):
    card, _, _, records, _ = shipped
    train = [r for r in records if r["split"] == "train"]
    val = [r for r in records if r["split"] == "val"]
    assert len(train) + len(val) == len(records)
    assert len(val) == card_number(card, "held-out split")
    assert len(train) == card_number(card, "training split")
    m = re.search(r"\| answer tokens \| ([\d,]+) train \+ ([\d,]+) held-out; ([\d,]+) of ([\d,]+) answers", card)
    n_train, n_val, n_trunc, n_all = (int(x.replace(",", "")) for x in m.groups())
    assert sum(len(r["answer_ids"]) for r in train) == n_train
    assert sum(len(r["answer_ids"]) for r in val) == n_val
    assert sum(r["truncated"] for r in records) == n_trunc and len(records) == n_all
    assert sum(len(r["prompt_ids"]) for r in records) == card_number(card, "prompt tokens")


def test_records_are_well_formed(shipped):
    _, _, _, records, DATA = shipped
    meta = json.loads((DATA / "meta.json").read_text())
    cap = meta["recipe"]["max_new_tokens"]
    assert len({r["key"] for r in records}) == len(records)
    for r in records:
        assert r["prompt_ids"] and r["answer_ids"]
        assert all(0 <= t < vocab_of(DATA) for t in r["prompt_ids"] + r["answer_ids"])
        assert len(r["answer_ids"]) <= cap
        # A truncated answer ran to the cap; a finished one is shorter or ends where the model stopped.
        assert not r["truncated"] or len(r["answer_ids"]) == cap
        assert (r["split"] == "val") == (r["key"] >= 10 ** 9)
