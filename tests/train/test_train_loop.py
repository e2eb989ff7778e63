"""The training loop on a tiny random target: learning, checkpoints, kill + resume, saved artefacts, EAGLE init,
feature cache."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.child_env import child_env
from helpers.train_tiny import make_trainer, tiny_examples, tiny_target
from poss.models.draft import PosSDraft
from poss.train.data import collate
from poss.train.features import CachedFeatures, FeatureCache, OnlineFeatures
from poss.train.validate import evaluate

TRAIN_TINY = Path(__file__).resolve().parents[1] / "helpers" / "train_tiny.py"


def test_training_reduces_the_loss(tmp_path):
    tr = make_trainer(tmp_path, method="poss", steps=2, ppl=1, n_train=4, batch_size=2, epochs=12, noise=0.0, lr=3e-3)
    ids = list(range(len(tr.train)))
    before = evaluate(tr.draft, tr.features, tr.train, ids, tr.cfg.objective(), tr.runner, tr.cfg.batch_size,
                      tr.cfg.autocast_dtype)
    result = tr.fit()
    after = evaluate(tr.draft, tr.features, tr.train, ids, tr.cfg.objective(), tr.runner, tr.cfg.batch_size,
                     tr.cfg.autocast_dtype)
    assert result["finished"] and result["progress"]["step"] == 24
    for k in range(2):
        assert after["loss"][k] < 0.8 * before["loss"][k]
    assert len(result["val"]["acc"]) == 2


def test_saved_draft_has_only_trainable_weights_and_the_recipe(tmp_path):
    tr = make_trainer(tmp_path, method="poss", steps=4, ppl=2, n_train=4, batch_size=2, epochs=1)
    tr.fit()
    d = tmp_path / "draft"
    cfg = json.loads((d / "config.json").read_text())
    rec = cfg["training"]["recipe"]
    assert rec["method"] == "poss" and rec["steps"] == 4 and rec["positions_per_specialist"] == 2 and rec["lr"] == 1e-3
    assert cfg["n_specialists"] == 2 and cfg["positions_per_specialist"] == 2
    assert cfg["training"]["data"]["train_fingerprint"] and cfg["training"]["data"]["n_train"] == 4
    assert len(cfg["training"]["val"]["acc"]) == 4
    assert cfg["training"]["init_from"] is None and cfg["training"]["machine"]["threads"] >= 1
    keys = load_file(str(d / "model.safetensors")).keys()
    assert keys and all(k.startswith(("fc.", "layers.")) for k in keys)
    n_params = sum(v.numel() for v in load_file(str(d / "model.safetensors")).values())
    assert n_params == sum(p.numel() for p in tr.draft.parameters())
    half = load_file(str(tmp_path / "draft-fp16" / "model.safetensors"))
    assert set(half) == set(keys) and all(v.dtype == torch.float16 for v in half.values())
    loaded = PosSDraft.load(d)
    for (n, a), (_, b) in zip(sorted(loaded.state_dict().items()), sorted(tr.draft.state_dict().items())):
        assert torch.equal(a, b), n


def test_poss_init_from_eagle_copies_the_layer(tmp_path):
    tr = make_trainer(tmp_path / "e", method="eagle2", steps=1, ppl=1, n_train=2, batch_size=2, epochs=1)
    tr.fit()
    eagle = PosSDraft.load(tmp_path / "e" / "draft")
    tp = make_trainer(tmp_path / "p", method="poss", steps=6, ppl=2, init_from=str(tmp_path / "e" / "draft"))
    assert tp.draft.config.n_specialists == 3
    rec = tp.training_record({})["init_from"]  # what the saved configs record: one level, no nested lineage
    from poss.train.draft_card import file_digest

    e_cfg = json.loads((tmp_path / "e" / "draft" / "config.json").read_text())
    assert rec["path"] == str(tmp_path / "e" / "draft") and rec["method"] == "EAGLE-2" and "training" not in rec
    assert rec["fingerprint"] == file_digest(tmp_path / "e" / "draft" / "model.safetensors")
    assert rec["tokens_total"] == e_cfg["training"]["tokens"] > 0
    torch.testing.assert_close(tp.draft.fc.weight, eagle.fc.weight, rtol=0, atol=0)
    for layer in tp.draft.layers:
        for (n, a), (_, b) in zip(layer.state_dict().items(), eagle.layers[0].state_dict().items()):
            assert torch.equal(a, b), n
    # A third round records the second's total, not its record: the lineage stays one level deep.
    tp.fit()
    t3 = make_trainer(tmp_path / "q", method="poss", steps=6, ppl=2, init_from=str(tmp_path / "p" / "draft"))
    rec3 = t3.training_record({})["init_from"]
    p_cfg = json.loads((tmp_path / "p" / "draft" / "config.json").read_text())
    assert rec3["tokens_total"] == p_cfg["training"]["tokens"] + e_cfg["training"]["tokens"]
    assert all(not isinstance(v, dict) for v in rec3.values())
    # ... and continues every specialist of a draft of the same layout, not specialist 0 copied thrice.
    trained = PosSDraft.load(tmp_path / "p" / "draft")
    assert not torch.equal(trained.layers[1].o_proj.weight, trained.layers[0].o_proj.weight)  # they diverged
    for j in range(3):
        for (n, a), (_, b) in zip(t3.draft.layers[j].state_dict().items(), trained.layers[j].state_dict().items()):
            assert torch.equal(a, b), (j, n)


def test_feature_cache_matches_online_and_is_reused(tmp_path):
    runner = tiny_target(max_batch=2)
    online = OnlineFeatures(runner)
    calls = []

    def counting(ids, lengths, indices=None):
        calls.append(ids.shape[0])
        return online(ids, lengths)

    counting.runner = runner
    counting.lm_head = runner.lm_head
    cached = CachedFeatures(counting, FeatureCache(tmp_path, shard_mb=0))  # shard_mb=0: flush on every put
    ex = tiny_examples(2)
    b = collate(ex)
    ref = online(b["input_ids"], b["lengths"])
    got = cached(b["input_ids"], b["lengths"], [7, 9])
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
    assert calls == [2]
    fresh = CachedFeatures(counting, FeatureCache(tmp_path))  # a new process reads the flushed shards
    torch.testing.assert_close(fresh(b["input_ids"], b["lengths"], [7, 9]), got)
    assert calls == [2] and len(list(tmp_path.glob("shard-*.safetensors"))) == 2


def _state(out):
    return torch.load(Path(out) / "trainer_state.pt", weights_only=False)


@pytest.mark.slow  # ~35 s: a training child process killed and resumed
def test_kill_and_resume_loses_at_most_one_interval_and_matches_an_uninterrupted_run(tmp_path):
    ref = make_trainer(tmp_path / "ref", n_train=8, batch_size=2, epochs=2)
    ref.fit()
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(TRAIN_TINY), str(out),
                             "--ckpt-minutes", "0", "--slow", "0.4"],
                            env=child_env(), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    step = 0
    while time.time() < deadline and proc.poll() is None:
        try:
            step = _state(out)["progress"]["step"]
        except Exception:
            step = 0
        if step >= 3:
            break
        time.sleep(0.1)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = _state(out)
    s = saved["progress"]["step"]
    assert 3 <= s < 8  # checkpoint interval 0 = every batch: at most the running batch is lost
    tr = make_trainer(out, n_train=8, batch_size=2, epochs=2)
    assert tr.resume()
    assert tr.progress["step"] == s and tr.sched.last_epoch == s
    for group in tr.opt.state.values():
        assert int(group["step"]) == s
    first = next(iter(saved["optimizer"]["state"].values()))
    torch.testing.assert_close(next(iter(tr.opt.state.values()))["exp_avg_sq"], first["exp_avg_sq"], rtol=0, atol=0)
    result = tr.fit()
    assert result["finished"] and result["progress"]["step"] == 8
    for (n, a), (_, b) in zip(sorted(tr.draft.state_dict().items()), sorted(ref.draft.state_dict().items())):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)


def test_cli_has_the_train_subcommand():
    import argparse

    from poss.cli.train import add_parser

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    a = parser.parse_args(["train", "--target", "smollm2-135m", "--method", "poss", "--positions-per-specialist", "2",
                           "--steps", "6", "--out", "x", "--resume"])
    assert (a.method, a.steps, a.positions_per_specialist, a.resume, a.features) == ("poss", 6, 2, True, "cache")
    with pytest.raises(ValueError):
        from poss.train.loop import TrainConfig

        TrainConfig(method="eagle2", steps=3)


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path):
    tr = make_trainer(tmp_path, n_train=4, batch_size=2, epochs=1, max_batches=1)
    tr.fit()
    assert make_trainer(tmp_path, n_train=4, batch_size=2, epochs=1).resume()
    with pytest.raises(ValueError, match="another run"):
        make_trainer(tmp_path, n_train=6, batch_size=2, epochs=1).resume()  # different data
    with pytest.raises(ValueError, match="another run"):
        make_trainer(tmp_path, n_train=4, batch_size=2, epochs=1, steps=2).resume()  # different method settings
    # What fixes the example order and the learning-rate schedule: a change would skip or repeat examples.
    for changed, kw in (("global_batch 2 (now 4)", dict(batch_size=4)), ("seed 0 (now 1)", dict(seed=1)),
                        ("epochs 1 (now 2)", dict(epochs=2)), ("lr 0.001 (now 0.002)", dict(lr=2e-3))):
        with pytest.raises(ValueError, match=re.escape(changed)):
            make_trainer(tmp_path, **{"n_train": 4, "batch_size": 2, "epochs": 1, **kw}).resume()


def test_a_max_batches_stop_on_an_epoch_boundary_still_validates_and_checkpoints_that_epoch(tmp_path):
    # 4 examples in batches of 2: the stop after 2 steps is the end of epoch 1.
    tr = make_trainer(tmp_path / "a", n_train=4, batch_size=2, epochs=3, max_batches=2, validate_every_epoch=True)
    result = tr.fit()
    assert not result["finished"] and (result["progress"]["epoch"], result["progress"]["batch"]) == (1, 0)
    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [x["val_epoch"]["epoch"] for x in lines if "val_epoch" in x] == [1]
    assert (tmp_path / "a" / "best" / "config.json").exists()
    resumed = make_trainer(tmp_path / "a", n_train=4, batch_size=2, epochs=3, validate_every_epoch=True)
    assert resumed.resume() and (resumed.progress["epoch"], resumed.progress["batch"]) == (1, 0)
    # The stop on the last batch of the last epoch finishes the run: final validation and the saved draft.
    done = make_trainer(tmp_path / "b", n_train=4, batch_size=2, epochs=1, max_batches=2).fit()
    assert done["finished"] and (tmp_path / "b" / "draft" / "config.json").exists()


def test_the_final_record_reuses_the_last_epochs_validation_and_scores_again_when_it_has_none(tmp_path, monkeypatch):
    import poss.train.loop as loop

    calls = []
    real = loop.evaluate

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(loop, "evaluate", counted)
    result = make_trainer(tmp_path / "a", n_train=4, batch_size=2, epochs=2, validate_every_epoch=True).fit()
    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    last_epoch = [x["val_epoch"]["val"] for x in lines if "val_epoch" in x][-1]
    assert len(calls) == 2 and result["val"] == last_epoch  # one per epoch, none again at the end
    calls.clear()
    result = make_trainer(tmp_path / "b", n_train=4, batch_size=2, epochs=2).fit()
    assert len(calls) == 1 and result["val"]["acc"]  # without epoch validations the end scores the draft
