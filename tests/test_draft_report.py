"""scripts/draft_report.py on fake drafts and runs: the model card states the recipe it reads, the tables
render, the learning curve counts on top of the init, and a cached validation is reused only while its key holds."""

import json
from pathlib import Path

import pytest

from helpers.scripts import load_script


@pytest.fixture(scope="module")
def rep():
    return load_script("draft_report")


def fake_config(method="poss", ppl=2, steps=6, autocast="bf16", tokens=257868, epoch=None, epochs=1,
                init_from="absent"):
    n_spec = 3 if method == "poss" else 1
    training = {
        "recipe": {"method": method, "steps": steps, "positions_per_specialist": ppl, "n_specialists": n_spec,
                   "epochs": epochs, "lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01, "warmup_frac": 0.01,
                   "clip_value": 0.5, "noise_std": 0.2, "v_weight": 1.0, "p_weight": 0.1, "topk_weight": 0.0,
                   "autocast": autocast, "batch_size": 4, "seed": 0, "max_batches": None},
        "data": {"source": "poss distill", "decoding": "greedy", "dtype": "float32", "max_new_tokens": 384,
                 "prompt_source": "sharegpt first user turn, English", "n_train": 732, "n_val": 100, "max_len": 1024,
                 "train_tokens": 257868, "train_fingerprint": "06dfb3821e6001a5",
                 "val_fingerprint": "7b020dbc9d6cad1f"},
        "world_size": 1, "train_seconds": 935.6, "tokens": tokens,
        "val": {"acc": [0.361, 0.276, 0.262, 0.256, 0.254, 0.248][:steps], "loss": [0.8] * steps},
    }
    if epoch is not None:
        training["epoch"] = epoch
    if init_from != "absent":
        training["init_from"] = init_from
    return {"target_name": "smollm2-135m", "target_fingerprint": "13bc15c4cd0799d1", "n_specialists": n_spec,
            "positions_per_specialist": ppl, "hidden": 576, "heads": 9, "kv_heads": 3, "ffn": 1536,
            "draft_vocab": 8192, "vocab": 49152, "training": training}


def fake_val(acc):
    key = {"draft_sha256_16": "0" * 16, "steps": 6, "dtype": "bfloat16", "autocast": "bf16",
           "split": "poss distill runs/distill", "val_fingerprint": "7b020dbc9d6cad1f", "n_val": 100}
    return {"key": key, "acc": acc, "loss": [0.9] * len(acc), "tokens": 27695}


def write_draft(folder: Path, cfg: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors").write_bytes(b"not really weights")
    return folder


def test_card_states_the_recipe_from_the_config(rep, tmp_path):
    init_dir = write_draft(tmp_path / "init",
                           fake_config("eagle2", 1, 1, autocast="none", tokens=773604, epoch=3, epochs=6))
    cfg = fake_config()
    run = tmp_path / "runs" / "poss2"
    d = rep.describe("poss2", write_draft(run / "draft-fp16", cfg), cfg, fake_val([0.36, 0.27, 0.26, 0.25, 0.25, 0.24]),
                     run, rep.init_of(cfg, run, init_dir))
    card = rep.model_card(d, 6)
    for fact in ("PosS-2", "8,192", "49,152", "output is unchanged", "3 specialists, 2 positions per specialist",
                 "732 training", "`06dfb3821e6001a5`", "epoch 3 of 6 planned", "773,604 token-passes",
                 "1,031,472 with the init's", "not recorded in this config", "bf16 autocast", "lr 0.001",
                 "16 min", "a shared 2-core CPU", "36.0 / 27.0 / 26.0", "36.1 / 27.6 / 26.2",
                 "bf16 autocast, batch size 4",
                 "scripts/train_smollm2_drafts.sh poss2", "python scripts/draft_report.py runs --ship poss2"):
        assert fact in card, fact
    cfg["training"]["machine"] = {"cpu": "AMD EPYC", "simd": ["avx2"], "threads": 1, "dtype": "bfloat16"}
    card = rep.model_card(d, 6)
    assert "on AMD EPYC (avx2; 1 thread)" in card and "bf16 autocast, target bfloat16" in card
    # The reproduce line carries every driver knob the recipe changed.
    more = fake_config(epochs=3)
    more["training"]["data"]["train_size"] = 3452
    card = rep.model_card({**d, "cfg": more, "recipe": more["training"]["recipe"]}, 6)
    assert (f"`DATA=<the float32 poss distill folder> INIT={d['init']['path']} TRAIN_SIZE=3452 EPOCHS=3 "
            "scripts/train_smollm2_drafts.sh poss2`") in card
    fp32 = fake_config("eagle2", 1, 1, autocast="none")
    assert "fp32, no autocast" in rep.model_card({**d, "cfg": fp32, "recipe": fp32["training"]["recipe"]}, 6)


def test_init_is_recorded_assumed_or_none(rep, tmp_path):
    init_dir = write_draft(tmp_path / "runs" / "eagle2-init" / "best", fake_config("eagle2", 1, 1, epoch=3))
    recorded = fake_config(init_from={"path": "drafts/eagle2",
                                      "training": fake_config("eagle2", 1, 1, epoch=3)["training"]})
    got = rep.init_of(recorded, None, init_dir)
    assert got["recorded"] and got["path"] == "drafts/eagle2" and got["epoch"] == 3
    # drafts/eagle2 is where the new draft ships, so the card says which version it started from.
    assert "the draft this one replaced in `drafts/`" in rep.init_text(got, recorded["training"]["recipe"])
    assert "replaced" not in rep.init_text({**got, "path": "runs/round3-best/poss2"}, recorded["training"]["recipe"])
    assert rep.init_of(fake_config(init_from=None), None, init_dir) is None
    assert rep.init_of(fake_config(), tmp_path / "runs" / "eagle2-init", init_dir) is None  # the run is the init
    assert rep.init_of(fake_config(), tmp_path / "runs" / "hass", init_dir)["recorded"] is False


def test_table_and_learning_curve(rep, tmp_path):
    run = tmp_path / "eagle2"
    cfg = fake_config("eagle2", 1, 1)
    write_draft(run / "draft-fp16", cfg)
    lines = [{"step": 10, "loss": 1.0}, {"val_epoch": {"epoch": 1, "tokens": 257868, "val": {"acc": [0.30]}}},
             {"val_epoch": {"epoch": 1, "tokens": 257868, "val": {"acc": [0.378]}}}]  # a resumed run logs twice
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"val_ep')  # cut by a kill
    init_dir = write_draft(tmp_path / "init", fake_config("eagle2", 1, 1, autocast="none", tokens=773604, epoch=3))
    init_row = rep.describe("init", init_dir, json.loads((init_dir / "config.json").read_text()),
                            fake_val([0.334] + [0.2] * 5), None, None, "EAGLE-2 init (epoch 3)")
    row = rep.describe("eagle2", run / "draft-fp16", cfg, fake_val([0.378] + [0.2] * 5), run, None)
    md = rep.table(sorted([row, init_row], key=rep.sort_key), 6)
    assert md.splitlines()[2].startswith("| EAGLE-2 init (epoch 3)") and "| 37.8 |" in md
    curve = {"label": "init run", "measured": "fp32", "points": [{"epoch": 3, "tokens": 773604, "acc1": 0.334}]}
    curves = rep.learning_curves(curve, [run], init_row, init_dir)
    assert [c["kind"] for c in curves] == ["init", "rescored", "run"]
    assert curves[2]["points"] == [(1031472, 0.378, 1)] and curves[2]["start"] == (773604, 0.334, 3)
    assert "| 1,031,472 | 37.8% |" in rep.curve_table(curves)


def test_cached_validation_is_reused_only_while_its_key_holds(rep, tmp_path, monkeypatch):
    data = tmp_path / "distill"
    data.mkdir()
    rec = {"key": 10 ** 9, "split": "val", "prompt_ids": [1, 2], "answer_ids": [3, 4, 5]}
    (data / "records.jsonl").write_text(json.dumps(rec) + "\n")
    cfg = fake_config()
    draft = write_draft(tmp_path / "run" / "draft-fp16", cfg)
    args = type("A", (), {"data": data, "steps": 6, "dtype_name": "bfloat16", "autocast": "bf16", "threads": 1})
    cache = tmp_path / "run" / "val-steps6.json"
    split = rep.heldout_split(cfg, data)
    key = {"draft_sha256_16": rep.file_digest(draft / "model.safetensors"), "steps": 6, "dtype": "bfloat16",
           "autocast": "bf16", **split}
    cache.write_text(json.dumps({"key": key, "acc": [0.5] * 6}))
    monkeypatch.setattr(rep.subprocess, "run", lambda *a, **k: pytest.fail("validated again despite a valid cache"))
    assert rep.validation(draft, cfg, cache, args)["acc"] == [0.5] * 6

    calls = []
    monkeypatch.setattr(rep.subprocess, "run", lambda cmd, **k: calls.append(cmd) or type(
        "R", (), {"stdout": json.dumps({"acc": [0.4] * 6})}))
    (draft / "model.safetensors").write_bytes(b"retrained")
    assert rep.validation(draft, cfg, cache, args)["acc"] == [0.4] * 6
    assert calls and calls[0][calls[0].index("--data") + 1] == str(data) and "--threads" in calls[0]


def test_token_passes_add_up_along_the_init_chain(rep, tmp_path):
    first = fake_config("eagle2", 1, 1, tokens=773604)["training"]
    second = fake_config("eagle2", 1, 1, tokens=354244, init_from={"path": "drafts/eagle2", "training": first})
    third = fake_config("eagle2", 1, 1, tokens=500000,
                        init_from={"path": "drafts/eagle2", "training": second["training"]})
    assert rep.cumulative_tokens(first) == 773604
    assert rep.cumulative_tokens(third["training"]) == 773604 + 354244 + 500000
    assert rep.init_of(third, None, None)["tokens"] == 773604 + 354244  # the init's own chain


def test_a_slice_of_the_data_is_named_in_the_card(rep):
    d = fake_config()["training"]["data"]
    assert rep.answers(d) == "732 training answers"
    d = {**d, "n_train": 3200, "train_size": 1684, "train_start": 1000}
    assert rep.answers(d) == "1,684 training answers (keys 1,000..2,683: those after the 1,000 earlier rounds saw)"


def test_the_learning_curve_is_eagle2s_only(rep, tmp_path):
    runs = []
    for name, method in (("eagle2", "eagle2"), ("hass", "hass")):
        run = tmp_path / name
        write_draft(run / "draft-fp16", fake_config(method, 1, 1))
        (run / "metrics.jsonl").write_text(
            json.dumps({"val_epoch": {"epoch": 1, "tokens": 100, "val": {"acc": [0.4]}}}))
        runs.append(run)
    curve = {"label": "init run", "measured": "fp32", "points": [{"epoch": 3, "tokens": 773604, "acc1": 0.334}]}
    got = rep.learning_curves(curve, runs, None, None)
    assert [c["label"] for c in got] == ["init run", f"EAGLE-2 (`{tmp_path.name}/eagle2`)"]


def test_a_curve_starts_at_the_init_only_for_runs_that_started_from_it(rep, tmp_path):
    init_dir = write_draft(tmp_path / "init", fake_config("eagle2", 1, 1, tokens=773604, epoch=3))
    init_row = rep.describe("init", init_dir, json.loads((init_dir / "config.json").read_text()),
                            fake_val([0.334] + [0.2] * 5), None, None, "EAGLE-2 init")
    earlier = {"path": str(tmp_path / "older"), "training": fake_config("eagle2", 1, 1, tokens=500000)["training"]}
    runs = []
    for name, init_from in (("from-init", {"path": str(init_dir), "training": init_row["cfg"]["training"]}),
                            ("from-older", earlier)):
        run = tmp_path / name
        write_draft(run / "draft-fp16", fake_config("eagle2", 1, 1, tokens=100, init_from=init_from))
        (run / "metrics.jsonl").write_text(
            json.dumps({"val_epoch": {"epoch": 1, "tokens": 100, "val": {"acc": [0.4]}}}))
        runs.append(run)
    curve = {"label": "init run", "measured": "fp32", "points": [{"epoch": 3, "tokens": 773604, "acc1": 0.334}]}
    got = {c["label"]: c for c in rep.learning_curves(curve, runs, init_row, init_dir)}
    assert got[f"EAGLE-2 (`{tmp_path.name}/from-init`)"]["start"] == (773604, 0.334, 3)
    older = got[f"EAGLE-2 (`{tmp_path.name}/from-older`)"]
    assert older["start"] is None and older["points"] == [(500100, 0.4, 1)]


def test_past_curves_survive_their_run_folders(rep, tmp_path):
    """A report saves its curves; the next one, whose machine lost the old run folders, draws them again,
    and a run that is still here replaces its saved curve."""
    runs = []
    for name, acc in (("round1", 0.40), ("round2", 0.46)):
        run = tmp_path / name / "eagle2"
        write_draft(run / "draft-fp16", fake_config("eagle2", 1, 1))
        (run / "metrics.jsonl").write_text(
            json.dumps({"val_epoch": {"epoch": 1, "tokens": 100, "val": {"acc": [acc]}}}))
        runs.append(run)
    curve = {"label": "init run", "measured": "fp32", "points": [{"epoch": 3, "tokens": 773604, "acc1": 0.334}]}
    saved = tmp_path / "curve.json"
    rep.write_curves(rep.learning_curves(curve, runs, None, None), saved)
    past = rep.read_past_curves(saved)
    assert [c["label"] for c in past] == ["EAGLE-2 (`round1/eagle2`)", "EAGLE-2 (`round2/eagle2`)"]

    (runs[1] / "metrics.jsonl").write_text(
        json.dumps({"val_epoch": {"epoch": 1, "tokens": 100, "val": {"acc": [0.50]}}}))  # round 2 rescored
    got = rep.learning_curves(curve, runs[1:], None, None, past)
    assert [(c["label"], c["points"]) for c in got] == [
        ("init run", [(773604, 0.334, 3)]),
        ("EAGLE-2 (`round1/eagle2`)", [(100, 0.40, 1)]),  # only in the saved file
        ("EAGLE-2 (`round2/eagle2`)", [(100, 0.50, 1)]),  # the live run, not its saved copy
    ]
    assert "| 100 | 40.0% |" in rep.curve_table(got)


def test_validation_precision_is_trainings(rep, monkeypatch):
    # `auto` resolves as `poss train` resolves it: fp32 (and an fp32 draft) on a CPU without hardware
    # bf16 even where bf16 inference is fast, bf16 with bf16 autocast where training runs bf16.
    import poss.hardware as hw

    monkeypatch.setattr(hw, "cpu_runs_bf16_fast", lambda: True)
    monkeypatch.setattr(hw, "cpu_has_fast_bf16", lambda: False)
    assert rep.validation_precision("auto") == ("float32", "none")
    assert rep.validation_precision("bfloat16") == ("bfloat16", "bf16")
    monkeypatch.setattr(hw, "cpu_has_fast_bf16", lambda: True)
    assert rep.validation_precision("auto") == ("bfloat16", "bf16")
    assert rep.validation_precision("float32") == ("float32", "none")
