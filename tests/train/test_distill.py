"""``poss distill``: on-policy records and features from the batched Generator, resumable."""

import json

import pytest
import torch

import poss.train.distill as distill_mod
from helpers.loop import hf_greedy, make_generator, tiny_target
from poss.train.distill import distill, is_english, load_examples, read_records, record_example, select_prompts
from poss.train.features import FeatureCache
from poss.train.loop import VAL_ID_OFFSET


def conversations(n, vocab=300):
    """Chat records whose first user turn is English text; prompts are its bytes folded into the vocab."""
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "theta"]
    return [[{"role": "user", "content": f"please explain {words[i % 8]} number {i} in detail"},
             {"role": "assistant", "content": "ok"}] for i in range(n)]


def encoder(vocab=300):
    """Text -> its bytes folded into the vocab; token ids pass through (as Generator.encode does)."""
    return lambda p: list(p) if isinstance(p, list) else [b % vocab for b in p.encode()][:24]


@pytest.fixture(scope="module")
def model():
    return tiny_target()


def test_is_english():
    assert is_english("How do I sort a list in Python?")
    assert not is_english("如何在Python中对列表进行排序？请详细说明")
    assert not is_english("hi")


def test_select_prompts_is_seeded_deduplicated_and_split():
    convs = conversations(40) + conversations(5)  # the last five repeat earlier prompts
    val, train = select_prompts(convs, encoder(), 20, 5, seed=3, max_prompt_tokens=100)
    assert len(val) == 5 and len(train) == 20
    firsts = [convs[i][0]["content"] for i, _ in val + train]
    assert len(set(firsts)) == len(firsts)
    assert (val, train) == select_prompts(convs, encoder(), 20, 5, seed=3, max_prompt_tokens=100)
    assert select_prompts(convs, encoder(), 20, 5, seed=4, max_prompt_tokens=100)[0] != val
    # a prompt over the token cap is never picked
    _, short = select_prompts(convs, lambda t: [0] * len(t), 45, 0, seed=3, max_prompt_tokens=38)
    assert all(len(p) <= 38 for _, p in short)


def test_records_are_greedy_answers_with_their_features(model, tmp_path):
    gen = make_generator(model)
    gen.encode = encoder()
    convs = conversations(12)
    meta = distill(gen, convs, tmp_path, n_train=6, n_val=2, batch_size=3, max_new_tokens=12, progress=False)
    recs = read_records(tmp_path)
    assert sorted(r["key"] for r in recs) == [0, 1, 2, 3, 4, 5, VAL_ID_OFFSET, VAL_ID_OFFSET + 1]
    assert meta["throughput"]["answer_tokens"] == sum(len(r["answer_ids"]) for r in recs)
    cache = FeatureCache(tmp_path / "features" / "rank0")
    for r in recs:
        # the answer is the target's own greedy continuation (HF as the independent reference)
        ref = hf_greedy(model, r["prompt_ids"], 12, eos_token_id=model.generation_config.eos_token_id)
        assert r["answer_ids"] == ref
        assert r["truncated"] == (len(ref) == 12 and ref[-1] != model.generation_config.eos_token_id)
        # the stored features are those of a fresh forward over prompt + answer[:-1]
        ids = r["prompt_ids"] + r["answer_ids"][:-1]
        _, f = gen.runner.prefill([ids])
        got = cache.get(r["key"]).float()
        assert got.shape == (len(ids), gen.runner.hidden_size)
        torch.testing.assert_close(got, f[0, : len(ids)].float(), atol=2e-3, rtol=2e-3)  # stored as fp16


def test_answers_refill_finished_rows_with_the_next_prompt(model, monkeypatch):
    """Continuous batching: a row whose answer ends takes the next prompt while the others run on, and
    every answer is still the target's own greedy one (HF as the reference)."""
    from poss.decode.engine import DecodeEngine

    gen = make_generator(model)
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(5 + i)] for i in range(6)]
    refs = [hf_greedy(model, p, 10) for p in prompts]
    gen.end_ids = {refs[0][2]}  # prompt 0 ends at its third token; the others end there or run to 10
    want = [r[: r.index(refs[0][2]) + 1] if refs[0][2] in r else r for r in refs]
    assert len(want[0]) == 3 and any(len(w) == 10 for w in want)
    rows = []
    real_step = DecodeEngine.step

    def step(engine):
        events = real_step(engine)
        rows.append(sorted(r.index for r in engine.batch.requests) if engine.batch is not None else [])
        return events

    monkeypatch.setattr(DecodeEngine, "step", step)
    got = dict(distill_mod.answers(gen, prompts, 10, batch_size=2))
    assert {i: r.generated for i, r in got.items()} == dict(enumerate(want))
    assert all(len(r) <= 2 for r in rows)
    # prompt 2 joined while prompt 1 was still running: its row did not wait for a whole batch
    assert any(1 in r and 2 in r for r in rows)


def test_examples_mask_the_answer(model, tmp_path):
    gen = make_generator(model)
    gen.encode = encoder()
    distill(gen, conversations(8), tmp_path, n_train=3, n_val=1, batch_size=2, max_new_tokens=8, progress=False)
    recs = {r["key"]: r for r in read_records(tmp_path)}
    train = load_examples(tmp_path, "train")
    assert len(train) == 3 and len(load_examples(tmp_path, "val")) == 1
    for k, ex in enumerate(train):
        r = recs[k]
        P, n = len(r["prompt_ids"]), len(r["answer_ids"])
        assert ex.input_ids.tolist() == (r["prompt_ids"] + r["answer_ids"])[:-1]
        assert ex.loss_mask.tolist() == [0] * P + [1] * (n - 1)


def test_an_answer_prefix_is_the_example_of_the_cut_answer():
    rec = {"prompt_ids": [10, 11, 12], "answer_ids": [20, 21, 22, 23, 24]}
    whole = record_example(rec)
    assert whole.input_ids.tolist() == [10, 11, 12, 20, 21, 22, 23]
    assert whole.loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 1]
    two = record_example(rec, answer_tokens=2)  # as if the answer had been [20, 21, 22]
    cut = record_example(dict(rec, answer_ids=[20, 21, 22]))
    assert two.input_ids.tolist() == cut.input_ids.tolist() == [10, 11, 12, 20, 21]
    assert two.loss_mask.tolist() == cut.loss_mask.tolist() == [0, 0, 0, 1, 1]
    assert record_example(rec, answer_tokens=50).input_ids.tolist() == whole.input_ids.tolist()
    assert record_example(rec, max_len=4).input_ids.tolist() == [10, 11, 12, 20]


def count_answered(monkeypatch):
    """A list that gets, per distill call, how many prompts it sent to be answered."""
    calls = []
    real = distill_mod.answers
    monkeypatch.setattr(distill_mod, "answers",
                        lambda gen, prompts, *a, **kw: calls.append(len(prompts)) or real(gen, prompts, *a, **kw))
    return calls


def test_resume_skips_done_keys_and_refuses_another_recipe(model, tmp_path, monkeypatch):
    gen = make_generator(model)
    gen.encode = encoder()
    convs = conversations(12)
    distill(gen, convs, tmp_path, n_train=4, n_val=0, batch_size=2, max_new_tokens=6, progress=False)
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    # a kill mid-write: keep two whole records and half a line
    (tmp_path / "records.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][:10])
    calls = count_answered(monkeypatch)
    distill(gen, convs, tmp_path, n_train=4, n_val=0, batch_size=2, max_new_tokens=6, progress=False)
    assert calls == [2]  # only the two lost records were redone
    keys = [r["key"] for r in read_records(tmp_path)]
    assert sorted(keys) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="another recipe"):
        distill(gen, convs, tmp_path, n_train=4, n_val=0, batch_size=2, max_new_tokens=7, progress=False)


def test_more_prompts_extend_the_data_set_and_fewer_are_refused(model, tmp_path, monkeypatch):
    gen = make_generator(model)
    gen.encode = encoder()
    convs = conversations(12)
    distill(gen, convs, tmp_path, n_train=3, n_val=1, batch_size=2, max_new_tokens=5, progress=False)
    first = {r["key"]: r for r in read_records(tmp_path)}
    calls = count_answered(monkeypatch)
    meta = distill(gen, convs, tmp_path, n_train=6, n_val=1, batch_size=4, max_new_tokens=5, progress=False)
    assert calls == [3]  # only the three new training prompts
    recs = {r["key"]: r for r in read_records(tmp_path)}
    assert sorted(k for k in recs if recs[k]["split"] == "train") == list(range(6))
    assert all(recs[k] == first[k] for k in first)  # the old records stay as they were
    assert meta["recipe"]["n_train"] == 6
    _, train = select_prompts(convs, encoder(), 6, 1, seed=0, max_prompt_tokens=384)
    assert [recs[k]["source_index"] for k in range(6)] == [i for i, _ in train]
    with pytest.raises(ValueError, match="fewer than the 6"):
        distill(gen, convs, tmp_path, n_train=5, n_val=1, batch_size=2, max_new_tokens=5, progress=False)


def test_meta_records_dtype(model, tmp_path):
    gen = make_generator(model)
    gen.encode = encoder()
    distill(gen, conversations(4), tmp_path, n_train=2, n_val=0, batch_size=2, max_new_tokens=4, progress=False)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["recipe"]["dtype"] == "float32" and meta["recipe"]["decoding"] == "greedy"


def test_features_rebuild_from_the_token_ids_alone(model, tmp_path):
    """A data set restored from its shipped records gets the same features back without generating."""
    import shutil

    from poss.train.distill import rebuild_features

    gen = make_generator(model)
    gen.encode = encoder()
    distill(gen, conversations(8), tmp_path / "a", n_train=5, n_val=1, batch_size=3, max_new_tokens=10, progress=False)
    (tmp_path / "b").mkdir()
    shutil.copy(tmp_path / "a" / "records.jsonl", tmp_path / "b" / "records.jsonl")
    assert rebuild_features(gen.runner, tmp_path / "b", batch_tokens=60, progress=False) == 6
    assert rebuild_features(gen.runner, tmp_path / "b", progress=False) == 0  # nothing left to do
    a, b = FeatureCache(tmp_path / "a" / "features" / "rank0"), FeatureCache(tmp_path / "b" / "features" / "rank0")
    for r in read_records(tmp_path / "a"):
        torch.testing.assert_close(b.get(r["key"]).float(), a.get(r["key"]).float(), atol=2e-3, rtol=2e-3)


def test_a_killed_rebuild_keeps_what_it_flushed(model, tmp_path):
    """Features reach disk every ``flush_seconds``: after a kill mid-way the flushed records stay,
    and the rerun computes only the rest."""
    import shutil

    from poss.train.distill import rebuild_features

    gen = make_generator(model)
    gen.encode = encoder()
    distill(gen, conversations(10), tmp_path / "a", n_train=7, n_val=1, batch_size=4, max_new_tokens=8, progress=False)
    (tmp_path / "b").mkdir()
    shutil.copy(tmp_path / "a" / "records.jsonl", tmp_path / "b" / "records.jsonl")
    real, calls = gen.runner.prefill, []

    def dies_on_third(seqs):
        calls.append(len(seqs))
        if len(calls) == 3:
            raise KeyboardInterrupt  # the kill
        return real(seqs)

    gen.runner.prefill = dies_on_third
    with pytest.raises(KeyboardInterrupt):
        rebuild_features(gen.runner, tmp_path / "b", batch_tokens=1, progress=False, flush_seconds=0)
    kept = sum(calls[:2])  # one record per batch at batch_tokens=1
    assert len(FeatureCache(tmp_path / "b" / "features" / "rank0").index) == kept == 2
    gen.runner.prefill = real
    assert rebuild_features(gen.runner, tmp_path / "b", progress=False) == 8 - kept


def test_features_dtype_is_recorded_and_never_mixed(model, tmp_path):
    """The rebuild records the dtype its features were computed in; a partly built cache is not
    filled in with features of another dtype, and the CLI's default dtype is the recorded one."""
    import shutil

    from poss.train.distill import features_dtype, rebuild_features

    gen = make_generator(model)
    gen.encode = encoder()
    distill(gen, conversations(8), tmp_path / "a", n_train=5, n_val=1, batch_size=3, max_new_tokens=6, progress=False)
    assert features_dtype(tmp_path / "a") == "float32"  # the generation run's own dtype
    (tmp_path / "b").mkdir()
    shutil.copy(tmp_path / "a" / "records.jsonl", tmp_path / "b" / "records.jsonl")
    assert features_dtype(tmp_path / "b") is None  # no meta.json: nothing known
    meta = json.loads((tmp_path / "a" / "meta.json").read_text())
    meta["recipe"]["dtype"] = "bfloat16"  # answers generated in bf16: a rebuild defaults to it
    del meta["features_dtype"]
    (tmp_path / "b" / "meta.json").write_text(json.dumps(meta))
    assert features_dtype(tmp_path / "b") == "bfloat16"
    assert rebuild_features(gen.runner, tmp_path / "b", progress=False) == 6  # empty cache: any dtype may start
    assert features_dtype(tmp_path / "b") == "float32"
    (tmp_path / "b" / "records.jsonl").write_text((tmp_path / "a" / "records.jsonl").read_text()
                                                  + json.dumps({**read_records(tmp_path / "a")[0], "key": 99}) + "\n")
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    meta["features_dtype"] = "bfloat16"  # the cache's features are another dtype's than this runner's
    (tmp_path / "b" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="--dtype bfloat16"):
        rebuild_features(gen.runner, tmp_path / "b", progress=False)
    assert 99 not in FeatureCache(tmp_path / "b" / "features" / "rank0")  # nothing was added


def test_training_from_a_later_answer_reads_that_answers_features(model, tmp_path):
    """``--train-start``: the examples and their feature-cache keys move together."""
    from poss.train.dataset import distilled_dataset
    from poss.train.features import OnlineFeatures
    from poss.train.loop import TrainConfig, Trainer

    gen = make_generator(model)
    gen.encode = encoder()
    distill(gen, conversations(12), tmp_path, n_train=5, n_val=1, batch_size=3, max_new_tokens=5, progress=False)
    fp = gen.runner.fingerprint()
    full = distilled_dataset(tmp_path, fp, 0, 10, 1)
    part = distilled_dataset(tmp_path, fp, 0, 2, 1, train_start=2)
    assert part.train_ids == [2, 3] and part.info["train_start"] == 2 and part.info["train_size"] == 2
    assert [e.input_ids.tolist() for e in part.train] == [e.input_ids.tolist() for e in full.train[2:4]]
    cfg = TrainConfig(method="eagle2", epochs=1, batch_size=2, lr=1e-3, autocast="none")
    tr = Trainer(gen.runner, cfg, part.train, part.val, tmp_path / "run", feature_cache=part.feature_cache,
                 progress_bar=False, train_ids=part.train_ids)
    seen, cached = [], tr.features
    tr.features = lambda ids, lengths, keys: (seen.append((keys, cached(ids, lengths, keys), ids, lengths))
                                              or seen[-1][1])
    tr.compute_gradients([1, 0])
    keys, got, ids, lengths = seen[0]
    assert keys == [3, 2]
    want = OnlineFeatures(gen.runner)(ids, lengths, keys)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(got[b, :n].float(), want[b, :n].float(), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="only 5 training"):
        distilled_dataset(tmp_path, fp, 0, 2, 1, train_start=5)
