"""Scoring saved drafts over any number of draft positions, and a feature cache shared by two processes."""

import pytest
import torch

from helpers.train_tiny import make_trainer, tiny_examples, tiny_target
from poss.train.data import collate
from poss.train.features import CachedFeatures, FeatureCache, OnlineFeatures
from poss.train.validate import draft_autocast, validate_draft


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("poss2")
    tr = make_trainer(out, method="poss", steps=4, ppl=2, n_train=4, batch_size=2, epochs=2)
    result = tr.fit()
    return tr, result, out / "draft"


def test_reproduces_the_trainers_own_validation(trained):
    # No autocast given: the draft runs as training ran it next to this fp32 runner (in fp32), as
    # `poss train --validate` does on a CPU without hardware bf16.
    tr, result, draft = trained
    assert tr.runner.dtype == torch.float32 and tr.cfg.autocast == draft_autocast(tr.runner.dtype) == "none"
    got = validate_draft(draft, tr.runner, tr.val, steps=4, batch_size=2)
    assert got["steps"] == 4 and got["tokens"] == result["val"]["tokens"]
    assert got["acc"] == result["val"]["acc"]
    torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(result["val"]["loss"]), rtol=1e-5, atol=1e-6)
    bf16 = validate_draft(draft, tr.runner, tr.val, steps=4, batch_size=2, autocast="bf16")
    assert bf16["loss"] != got["loss"]  # the precision is not a no-op: the default picked fp32
    with pytest.raises(ValueError, match="autocast must be 'bf16' or 'none', got 'fp16'"):
        validate_draft(draft, tr.runner, tr.val, steps=1, autocast="fp16")


def test_draft_autocast_follows_the_target_dtype():
    assert draft_autocast(torch.bfloat16) == "bf16"
    assert draft_autocast(torch.float32) == "none"


def test_more_steps_extend_without_changing_earlier_ones(trained):
    tr, _, draft = trained
    four = validate_draft(draft, tr.runner, tr.val, steps=4, batch_size=2, autocast="none")
    six = validate_draft(draft, tr.runner, tr.val, steps=6, batch_size=2, autocast="none")
    assert len(six["acc"]) == len(six["loss"]) == 6
    assert six["acc"][:4] == four["acc"]
    one = validate_draft(draft, tr.runner, tr.val, steps=1, batch_size=2, autocast="none")
    assert one["acc"] == four["acc"][:1]


def test_rejects_a_draft_of_another_target_and_bad_steps(trained):
    _, _, draft = trained
    other = tiny_target(seed=5, max_batch=2)
    with pytest.raises(ValueError, match="another target"):
        validate_draft(draft, other, tiny_examples(2), steps=2)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        validate_draft(draft, other, tiny_examples(2), steps=0)


def test_two_writers_share_one_feature_cache_folder(tmp_path):
    runner = tiny_target(max_batch=2)
    online = OnlineFeatures(runner)
    ex = collate(tiny_examples(2))
    a = CachedFeatures(online, FeatureCache(tmp_path))
    b = CachedFeatures(online, FeatureCache(tmp_path))  # opened before a has written anything
    fa = a(ex["input_ids"], ex["lengths"], [1, 2])
    a.cache.flush()
    fb = b(ex["input_ids"], ex["lengths"], [3, 4])
    b.cache.flush()
    fresh = FeatureCache(tmp_path)
    assert all(i in fresh for i in (1, 2, 3, 4))
    L = int(ex["lengths"][0])
    torch.testing.assert_close(fresh.get(1).float(), fa[0, :L].float())
    torch.testing.assert_close(fresh.get(3).float(), fb[0, :L].float())


def test_cli_needs_an_out_dir_or_a_draft_to_validate(tmp_path, capsys):
    from poss.cli import main

    assert main(["train", "--method", "poss"]) == 2
    assert "--out DIR is required" in capsys.readouterr().err
    assert main(["train", "--validate", str(tmp_path)]) == 2
    assert "--validate expects a draft folder with config.json" in capsys.readouterr().err
