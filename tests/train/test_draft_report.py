"""scripts/draft_report.py on fake drafts and runs: the tables render, the learning curve counts on top of
the init, and a cached validation is reused only while its key holds (the model card: test_release.py)."""

import json

import pytest

from helpers.fake_drafts import fake_config, fake_val, write_draft
from helpers.scripts import load_script


@pytest.fixture(scope="module")
def rep():
    return load_script("draft_report")


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
