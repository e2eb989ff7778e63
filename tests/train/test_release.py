"""Releasing drafts and data (poss.train.release, poss.train.draft_card, ``poss release``): the model card
states the recipe it reads, the draft's lineage and token-passes add up, a released draft folder holds the
weights and the card, and a released data set's card carries the counts of the file written next to it."""

import hashlib
import json
import lzma

import pytest

from helpers.fake_drafts import fake_config, fake_val, write_draft
from poss.cli import main
from poss.train import draft_card as dc


def test_card_states_the_recipe_from_the_config(tmp_path):
    init_dir = write_draft(tmp_path / "init",
                           fake_config("eagle2", 1, 1, autocast="none", tokens=773604, epoch=3, epochs=6))
    cfg = fake_config()
    run = tmp_path / "runs" / "poss2"
    d = dc.describe("poss2", write_draft(run / "draft-fp16", cfg), cfg, fake_val([0.36, 0.27, 0.26, 0.25, 0.25, 0.24]),
                     run, dc.init_of(cfg, run, init_dir))
    card = dc.model_card(d, 6)
    for fact in ("PosS-2", "8,192", "49,152", "output is unchanged", "3 specialists, 2 positions per specialist",
                 "732 training", "`06dfb3821e6001a5`", "epoch 3 of 6 planned", "773,604 token-passes",
                 "1,031,472 with the init's", "not recorded in this config", "bf16 autocast", "lr 0.001",
                 "16 min", "a shared 2-core CPU", "36.0 / 27.0 / 26.0", "36.1 / 27.6 / 26.2",
                 "bf16 autocast, batch size 4",
                 "scripts/train_drafts.sh poss2", "poss release draft runs/poss2"):
        assert fact in card, fact
    cfg["training"]["machine"] = {"cpu": "AMD EPYC", "simd": ["avx2"], "threads": 1, "dtype": "bfloat16"}
    card = dc.model_card(d, 6)
    assert "on AMD EPYC (avx2; 1 thread)" in card and "bf16 autocast, target bfloat16" in card
    # The reproduce line carries every driver knob the recipe changed.
    more = fake_config(epochs=3)
    more["training"]["data"]["train_size"] = 3452
    card = dc.model_card({**d, "cfg": more, "recipe": more["training"]["recipe"]}, 6)
    assert (f"`DATA=<the float32 poss distill folder> INIT={d['init']['path']} TRAIN_SIZE=3452 EPOCHS=3 "
            "scripts/train_drafts.sh poss2`") in card
    fp32 = fake_config("eagle2", 1, 1, autocast="none")
    assert "fp32, no autocast" in dc.model_card({**d, "cfg": fp32, "recipe": fp32["training"]["recipe"]}, 6)


def test_init_is_recorded_assumed_or_none(tmp_path):
    init_dir = write_draft(tmp_path / "runs" / "eagle2-init" / "best", fake_config("eagle2", 1, 1, epoch=3))
    recorded = fake_config(init_from={"path": "drafts/eagle2",
                                      "training": fake_config("eagle2", 1, 1, epoch=3)["training"]})
    got = dc.init_of(recorded, None, init_dir)
    assert got["recorded"] and got["path"] == "drafts/eagle2" and got["epoch"] == 3
    # drafts/eagle2 is where the new draft ships, so the card says which version it started from.
    assert "the draft this one replaced in `drafts/`" in dc.init_text(got, recorded["training"]["recipe"])
    assert "replaced" not in dc.init_text({**got, "path": "runs/round3-best/poss2"}, recorded["training"]["recipe"])
    assert dc.init_of(fake_config(init_from=None), None, init_dir) is None
    assert dc.init_of(fake_config(), tmp_path / "runs" / "eagle2-init", init_dir) is None  # the run is the init
    assert dc.init_of(fake_config(), tmp_path / "runs" / "hass", init_dir)["recorded"] is False


def test_token_passes_add_up_along_the_init_chain(tmp_path):
    first = fake_config("eagle2", 1, 1, tokens=773604)["training"]
    second = fake_config("eagle2", 1, 1, tokens=354244, init_from={"path": "drafts/eagle2", "training": first})
    third = fake_config("eagle2", 1, 1, tokens=500000,
                        init_from={"path": "drafts/eagle2", "training": second["training"]})
    assert dc.cumulative_tokens(first) == 773604
    assert dc.cumulative_tokens(third["training"]) == 773604 + 354244 + 500000
    assert dc.init_of(third, None, None)["tokens"] == 773604 + 354244  # the init's own chain


def test_a_slice_of_the_data_is_named_in_the_card():
    d = fake_config()["training"]["data"]
    assert dc.answers(d) == "732 training answers"
    d = {**d, "n_train": 3200, "train_size": 1684, "train_start": 1000}
    assert dc.answers(d) == "1,684 training answers (keys 1,000..2,683: those after the 1,000 earlier rounds saw)"


def finished_run(tmp_path, name="poss2"):
    """A finished run folder (draft-fp16/ and its cached validation over 6 positions)."""
    init = {"path": "drafts/eagle2", "training": fake_config("eagle2", 1, 1, epoch=3)["training"]}
    run = tmp_path / "runs" / name
    write_draft(run / "draft-fp16", fake_config(init_from=init))
    (run / "val-steps6.json").write_text(json.dumps(fake_val([0.36, 0.27, 0.26, 0.25, 0.25, 0.24])))
    return run


def test_poss_release_draft_copies_the_weights_with_the_card(tmp_path, capsys):
    run = finished_run(tmp_path)
    assert main(["release", "draft", str(run), "--dest", str(tmp_path / "drafts")]) == 0
    out = tmp_path / "drafts" / "poss2"
    for name in ("config.json", "model.safetensors"):
        assert (out / name).read_bytes() == (run / "draft-fp16" / name).read_bytes()
    card = (out / "README.md").read_text()
    assert card.startswith("# PosS-2 draft") and "36.0 / 27.0 / 26.0 / 25.0 / 25.0 / 24.0 %" in card
    assert "`--init-from drafts/eagle2`" in card and "released" in capsys.readouterr().err
    assert main(["release", "draft", str(run), "--dest", str(tmp_path / "drafts"), "--name", "poss2-b"]) == 0
    assert (tmp_path / "drafts" / "poss2-b" / "README.md").read_text().startswith("# PosS-2 draft")


@pytest.mark.parametrize("case,flag", [("no-run", "RUN"), ("no-validation", "--validation"),
                                       ("short-validation", "--validation"), ("bad-init", "--init")])
def test_poss_release_draft_refuses_before_writing(case, flag, tmp_path, capsys):
    run = finished_run(tmp_path)
    argv = ["release", "draft", str(run), "--dest", str(tmp_path / "drafts")]
    if case == "no-run":
        argv[2] = str(tmp_path / "runs")
    elif case == "no-validation":
        (run / "val-steps6.json").unlink()
    elif case == "short-validation":
        argv += ["--steps", "4"]  # the file covers 6 positions, not 4
        (run / "val-steps4.json").write_text((run / "val-steps6.json").read_text())
    else:
        argv += ["--init", str(tmp_path / "nowhere")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("poss release: ") and flag in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "drafts").exists()


def distill_run(folder, keys):
    """A ``poss distill`` output folder with training records of ``keys`` and two held-out ones."""
    folder.mkdir(parents=True)
    recipe = {"dtype": "bfloat16", "max_new_tokens": 4, "max_prompt_tokens": 384, "seed": 0, "n_train": 10}
    (folder / "meta.json").write_text(json.dumps({"recipe": recipe,
                                                  "throughput": {"tokens_per_s": 50.0, "seconds": 7200.0}}))
    recs = [{"key": k, "split": "train", "source_index": k, "prompt_ids": [1, 2, 3], "answer_ids": [5] * (k + 1),
             "truncated": k == 3} for k in keys]
    recs += [{"key": 10 ** 9 + i, "split": "val", "source_index": 100 + i, "prompt_ids": [1], "answer_ids": [6, 6],
              "truncated": False} for i in range(2)]
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reversed(recs)))  # any order
    return recs


def test_poss_release_data_writes_the_records_and_a_card_that_matches_them(tmp_path, capsys):
    recs = distill_run(tmp_path / "run", [0, 1, 2, 3])
    out = tmp_path / "data" / "distill-x"
    assert main(["release", "data", str(tmp_path / "run"), str(out), "--note", "Made on a test."]) == 0
    packed = (out / "records.jsonl.xz").read_bytes()
    raw = lzma.decompress(packed)
    assert [json.loads(line) for line in raw.decode().splitlines()] == sorted(recs, key=lambda r: r["key"])
    card = (out / "README.md").read_text()
    assert f"sha256 `{hashlib.sha256(packed).hexdigest()}` (uncompressed `{hashlib.sha256(raw).hexdigest()}`)" in card
    train_tokens = sum(len(r["answer_ids"]) for r in recs if r["split"] == "train")
    held_out_tokens = sum(len(r["answer_ids"]) for r in recs if r["split"] == "val")
    assert f"| answer tokens | {train_tokens:,} train + {held_out_tokens:,} held-out; 1 of {len(recs)} answers" in card
    assert "| held-out split | 2 prompts" in card and "| training split | 4 prompts" in card
    assert "Made on a test." in card and "2.0 h of generation" in card
    assert json.loads((out / "meta.json").read_text()) == json.loads((tmp_path / "run" / "meta.json").read_text())
    assert f"{len(recs)} records" in capsys.readouterr().out


def test_poss_release_data_refuses_a_gap_and_a_folder_without_records(tmp_path, capsys):
    distill_run(tmp_path / "gap", [0, 1, 3])  # key 2 missing: an unfinished run
    assert main(["release", "data", str(tmp_path / "gap"), str(tmp_path / "out")]) == 2
    assert "training keys are not 0..2" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["release", "data", str(tmp_path / "empty"), str(tmp_path / "out2")]) == 2
    assert "FOLDER" in capsys.readouterr().err and not (tmp_path / "out2").exists()
