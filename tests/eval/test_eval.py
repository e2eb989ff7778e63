"""``poss eval``: the metrics against a hand-computed example, and an end-to-end run on a tiny model."""

import json
import math
import shutil

import pytest
import torch

from poss.eval.metrics import mean_tau, pos_acc, speedup, summarize, tau_of


def test_metrics_by_hand():
    # Question A: rounds accepting 0, 2, 2, 3 draft tokens -> hist [1, 0, 2, 1]: tau = (1 + 3 + 3 + 4) / 4 = 2.75
    # Question B: rounds accepting 1, 1 -> hist [0, 2]: tau = 2
    a, b = [1, 0, 2, 1], [0, 2]
    assert tau_of(a) == 2.75 and tau_of(b) == 2.0
    assert mean_tau([a, b]) == pytest.approx((2.75 + 2.0) / 2)  # per question, then the mean
    # pooled hist [1, 2, 2, 1]: 6 rounds reached 0; 5 accepted >= 1; 3 accepted >= 2; 1 accepted >= 3
    assert pos_acc([1, 2, 2, 1], 4) == [5 / 6, 3 / 5, 1 / 3, 0.0]  # the one round reaching position 4 stopped there
    assert math.isnan(pos_acc([3, 0, 0], 3)[1])  # no round accepted position 1, so position 2 was never tried
    assert speedup(200, 10.0, 100, 10.0) == 2.0


def test_summarize_pools_turns_then_questions():
    q1 = {"turns": [{"tokens": 5, "seconds": 1.0, "accept_hist": [1, 0, 1]},  # turn 1: 1 + 3 tokens
                    {"tokens": 2, "seconds": 1.0, "accept_hist": [0, 1]}]}  # turn 2: 2 tokens
    q2 = {"turns": [{"tokens": 3, "seconds": 2.0, "accept_hist": [3]}]}
    s = summarize([q1, q2], depth=2)
    assert s["accept_hist"] == [4, 1, 1] and s["rounds"] == 6
    assert s["tau"] == pytest.approx(((1 + 3 + 2) / 3 + 1.0) / 2)
    assert s["tokens"] == 10 and s["seconds"] == 4.0 and s["turns"] == 3


# -- end to end on a tiny model ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random Llama saved as an HF folder with a ChatML byte tokenizer, plus two random drafts."""
    from helpers.targets import tiny_chat_folder

    return tiny_chat_folder(tmp_path_factory.mktemp("eval"), [("eagle", 1, 0), ("poss-k", 3, 150)])


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_end_to_end(tiny_folder, tmp_path):
    from poss.cli import main

    torch.set_num_threads(1)
    data = jsonl(tmp_path / "mini.jsonl", [{"question_id": i, "turns": [f"say {i}", "and again"]} for i in range(3)])
    out = tmp_path / "out"
    def argv(limit):
        return ["eval", "--target", str(tiny_folder / "target"), "--drafts", str(tiny_folder / "eagle"),
                str(tiny_folder / "poss-k"), "--datasets", "none", "--dataset", str(data), "--limit", str(limit),
                "--max-new-tokens", "12", "--num-nodes", "10", "--depth", "3", "--beam-width", "3", "--out", str(out)]

    assert main(argv(2)) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["methods"]) == {"ar", "eagle", "poss-k"}
    for name in ("eagle", "poss-k"):
        m = res["methods"][name]
        assert m["identical"] == [2, 2]  # lossless: every greedy answer equals the AR loop's
        assert m["datasets"]["mini"]["questions"] == 2 and m["datasets"]["mini"]["turns"] == 4
        assert m["overall"]["tau"] >= 1.0 and len(m["overall"]["pos_acc"]) == 3
        assert m["draft_params_mb"] > 0
    recs = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(recs) == 6 and all(len(r["turns"]) == 2 for r in recs)
    # the metrics in results.json are those of the records
    eag = [r for r in recs if r["method"] == "eagle"]
    hist = [sum(col) for col in zip(*[t["accept_hist"] for r in eag for t in r["turns"]])]
    assert res["methods"]["eagle"]["overall"]["accept_hist"] == hist
    table = (out / "table.md").read_text()
    assert "| eagle |" in table and "2/2" in table
    # intervals and the paired comparison of the two drafts reach results.json and the table
    lo, hi = res["methods"]["eagle"]["overall"]["tau_ci"]
    assert lo <= res["methods"]["eagle"]["overall"]["tau"] <= hi
    assert [(c["a"], c["b"], c["questions"]) for c in res["comparisons"]] == [("poss-k", "eagle", 2)]
    assert "| poss-k - eagle | 2 |" in table and "reached 3" in table
    assert (out / "pos_acc.png").stat().st_size > 0 and (out / "tau.png").stat().st_size > 0

    # resume: nothing left to do, the records are not duplicated
    assert main(argv(2)) == 0
    assert len((out / "records.jsonl").read_text().splitlines()) == 6
    # one more question: only it is answered
    assert main(argv(3)) == 0
    assert len((out / "records.jsonl").read_text().splitlines()) == 9


def test_eval_with_lookup_keeps_plain_decoding_as_the_baseline(tiny_folder, tmp_path):
    from poss.cli import main

    torch.set_num_threads(1)
    data = jsonl(tmp_path / "mini.jsonl", [{"question_id": i, "turns": [f"say {i} say {i} say"]} for i in range(2)])
    out = tmp_path / "out"
    assert main(["eval", "--target", str(tiny_folder / "target"), "--drafts", str(tiny_folder / "eagle"),
                 "--datasets", "none", "--dataset", str(data), "--max-new-tokens", "24", "--num-nodes", "4",
                 "--depth", "1", "--beam-width", "3", "--lookup", "4", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["methods"]["eagle"]["identical"] == [2, 2]
    recs = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    ar = [t for r in recs if r["method"] == "ar" for t in r["turns"]]
    # one token a round after the prefill's: plain decoding, no lookup in the baseline
    assert all(t["accept_hist"] == [t["tokens"] - 1] for t in ar)


def test_eval_first_turns_only(tiny_folder, tmp_path):
    from poss.cli import main

    torch.set_num_threads(1)
    data = jsonl(tmp_path / "mini.jsonl", [{"question_id": i, "turns": [f"say {i}", "and again"]} for i in range(2)])
    out = tmp_path / "out"
    assert main(["eval", "--target", str(tiny_folder / "target"), "--drafts", str(tiny_folder / "eagle"),
                 "--datasets", "none", "--dataset", str(data), "--turns", "1", "--max-new-tokens", "8",
                 "--num-nodes", "10", "--depth", "3", "--beam-width", "3", "--out", str(out)]) == 0
    recs = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and all(len(r["turns"]) == 1 for r in recs)


def test_eval_full_draft_vocab_is_its_own_method_beside_the_trained_one(tiny_folder, tmp_path):
    from poss.cli import main

    torch.set_num_threads(1)
    data = jsonl(tmp_path / "mini.jsonl", [{"question_id": i, "turns": [f"say {i}"]} for i in range(2)])
    out = tmp_path / "out"
    def argv(vocab):
        return ["eval", "--target", str(tiny_folder / "target"), "--drafts", str(tiny_folder / "poss-k"),
                "--datasets", "none", "--dataset", str(data), "--max-new-tokens", "8", "--num-nodes", "10",
                "--depth", "3", "--beam-width", "3", "--draft-vocab", vocab, "--out", str(out)]

    assert main(argv("trained")) == 0 and main(argv("full")) == 0  # the second run adds to the first
    res = json.loads((out / "results.json").read_text())
    assert set(res["methods"]) == {"ar", "poss-k", "poss-k+full-vocab"}
    assert res["methods"]["poss-k+full-vocab"]["identical"] == [2, 2]
    mb = {n: res["methods"][n]["draft_params_mb"] for n in ("poss-k", "poss-k+full-vocab")}
    assert mb["poss-k"] == mb["poss-k+full-vocab"]  # the head is the target's, not a parameter


def test_eval_resume_refuses_other_settings_and_another_draft_of_the_same_name(tiny_folder, tmp_path, capsys):
    from poss.cli import main

    torch.set_num_threads(1)
    data = jsonl(tmp_path / "mini.jsonl", [{"question_id": i, "turns": [f"say {i}"]} for i in range(2)])
    out = tmp_path / "out"
    def argv(draft, *extra):
        return ["eval", "--target", str(tiny_folder / "target"), "--drafts", str(draft), "--datasets", "none",
                "--dataset", str(data), "--limit", "1", "--max-new-tokens", "8", "--num-nodes", "10",
                "--depth", "3", "--beam-width", "3", "--out", str(out), *extra]

    assert main(argv(tiny_folder / "eagle")) == 0
    before = (out / "records.jsonl").read_text()
    assert main(argv(tiny_folder / "eagle", "--max-new-tokens", "12")) == 2
    assert "max_new_tokens 8 (now 12)" in capsys.readouterr().err
    other = tmp_path / "elsewhere" / "eagle"  # another draft that goes by the same name
    shutil.copytree(tiny_folder / "poss-k", other)
    assert main(argv(other)) == 2
    assert "another draft named 'eagle'" in capsys.readouterr().err
    assert (out / "records.jsonl").read_text() == before  # nothing was added to the refused folder
    shutil.copytree(tiny_folder / "eagle", other, dirs_exist_ok=True)  # the same weights elsewhere resume
    assert main(argv(other, "--limit", "2")) == 0
    assert len((out / "records.jsonl").read_text().splitlines()) == 4


def test_eval_resume_after_a_kill_mid_line_redoes_that_question_and_loses_none(tiny_folder, tmp_path):
    from poss.cli import main

    torch.set_num_threads(1)
    data = jsonl(tmp_path / "mini.jsonl", [{"question_id": i, "turns": [f"say {i}"]} for i in range(3)])
    out = tmp_path / "out"
    argv = ["eval", "--target", str(tiny_folder / "target"), "--drafts", "--datasets", "none", "--dataset",
            str(data), "--max-new-tokens", "6", "--out", str(out)]
    assert main(argv + ["--limit", "2"]) == 0  # --drafts with no folder: ar only
    lines = (out / "records.jsonl").read_text().splitlines(keepends=True)
    (out / "records.jsonl").write_text(lines[0] + lines[1][:25])  # killed while writing question 1
    assert main(argv) == 0
    recs = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    assert sorted(r["question_id"] for r in recs) == [0, 1, 2]


def test_speedup_is_timed_on_the_questions_both_methods_answered():
    from poss.eval.report import build

    def rec(method, q, tokens, seconds):
        return {"method": method, "dataset": "d", "question_id": q,
                "turns": [{"tokens": tokens, "seconds": seconds, "accept_hist": [tokens], "token_ids": [0]}]}

    # ar: question 1 runs at 100 tokens/s, question 2 at 10; x answered only question 1, at ar's speed
    res = build([rec("ar", 1, 100, 1.0), rec("ar", 2, 10, 1.0), rec("x", 1, 100, 1.0)], 6, {"temperature": 0})
    assert res["methods"]["x"]["datasets"]["d"]["speedup"] == pytest.approx(1.0)
    assert res["methods"]["x"]["overall"]["speedup"] == pytest.approx(1.0)


@pytest.mark.parametrize("bad,msg", [(["--limit", "0"], "--limit"), (["--temperature", "-1"], "--temperature"),
                                     (["--drafts", "nowhere"], "--drafts"), (["--datasets", "nope"], "--datasets"),
                                     (["--turns", "0"], "--turns"), (["--draft-vocab", "all"], "--draft-vocab"),
                                     (["--shard", "2/2"], "--shard"), (["--shard", "1"], "--shard"),
                                     (["--shard", "-1/2"], "--shard")])
def test_eval_bad_arguments(bad, msg, tmp_path, capsys):
    from poss.cli import main

    assert main(["eval", "--out", str(tmp_path)] + bad) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("extra,msg", [
    (["--merge", "{tmp}/nowhere"], "--merge: "),  # not a poss eval folder
    (["--merge", "{tmp}/a", "--limit", "3"], "--limit"),  # a run's flag: the settings come from the folders
    (["--merge", "{tmp}/a", "--questions", "3:3"], "--questions"),
    (["--questions", "0:2"], "--questions needs --merge"),
])
def test_merge_bad_arguments(extra, msg, tmp_path, capsys):
    from poss.cli import main

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "results.json").write_text("{}")
    assert main(["eval", "--out", str(tmp_path / "m")] + [x.format(tmp=tmp_path) for x in extra]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.startswith("poss eval") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "m").exists()


def test_shards_answer_each_question_once_and_merge_into_the_unsharded_run(tiny_folder, tmp_path):
    """``--shard I/N`` splits the questions (after --limit) by position; the merged shards hold the
    same questions and the same answers as one process answering them all."""
    from poss.cli import main
    from poss.jsonl import read_jsonl

    torch.set_num_threads(1)
    data = jsonl(tmp_path / "mini.jsonl", [{"question_id": f"q{i}", "turns": [f"say {i}"]} for i in range(6)])

    def run(out, *extra):
        assert main(["eval", "--target", str(tiny_folder / "target"), "--drafts", str(tiny_folder / "eagle"),
                     "--datasets", "none", "--dataset", str(data), "--limit", "5", "--max-new-tokens", "6",
                     "--num-nodes", "6", "--depth", "2", "--beam-width", "3", "--out", str(out), *extra]) == 0
        return by_key(out)

    def by_key(out):
        return {(r["method"], r["question_id"]): r for r in read_jsonl(out / "records.jsonl")}

    whole = run(tmp_path / "whole")
    shards = [run(tmp_path / f"s{i}", "--shard", f"{i}/3") for i in range(3)]
    assert [sorted({q for _, q in s}) for s in shards] == [["q0", "q3"], ["q1", "q4"], ["q2"]]
    shard_dirs = [str(tmp_path / f"s{i}") for i in range(3)]
    assert main(["eval", "--out", str(tmp_path / "merged"), "--merge", *shard_dirs]) == 0
    merged = by_key(tmp_path / "merged")
    assert merged.keys() == whole.keys() and len(whole) == 10  # ar and eagle, 5 questions each
    for key, r in whole.items():
        assert [t["token_ids"] for t in merged[key]["turns"]] == [t["token_ids"] for t in r["turns"]]
        assert [t["accept_hist"] for t in merged[key]["turns"]] == [t["accept_hist"] for t in r["turns"]]


def test_merge_two_runs_and_a_question_range(tiny_folder, tmp_path):
    """poss.eval.merge: two runs over different sets make one report; ``--questions`` keeps a
    range of positions per set; runs with different settings are refused."""
    from poss.cli import main
    from poss.data.eval_sets import load_eval_set
    from poss.eval import merge as em
    torch.set_num_threads(1)

    def run(sets, out, new=6):
        assert main(["eval", "--target", str(tiny_folder / "target"), "--drafts", str(tiny_folder / "eagle"),
                     "--datasets", sets, "--limit", "3", "--turns", "1", "--max-new-tokens", str(new),
                     "--num-nodes", "6", "--depth", "2", "--beam-width", "3", "--out", str(out)]) == 0

    run("alpaca", tmp_path / "a")  # sets whose first questions fit the tiny model's 256-token context
    run("qa", tmp_path / "b")
    res = em.merge([tmp_path / "a", tmp_path / "b"], tmp_path / "all")
    assert sorted(res["methods"]["eagle"]["datasets"]) == ["alpaca", "qa"]
    alone = json.loads((tmp_path / "a" / "results.json").read_text())
    same = json.dumps  # NaN-aware equality (pos-acc is NaN at depths no round reached)
    assert same(res["methods"]["eagle"]["datasets"]["alpaca"]) == same(alone["methods"]["eagle"]["datasets"]["alpaca"])
    assert res["methods"]["eagle"]["identical"] == [6, 6] and (tmp_path / "all" / "draft-eagle.json").exists()

    part = em.merge([tmp_path / "a", tmp_path / "b"], tmp_path / "part", questions=(1, 3))
    kept = {(json.loads(line)["dataset"], json.loads(line)["question_id"])
            for line in (tmp_path / "part" / "records.jsonl").read_text().splitlines()}
    want = {(ds, r["question_id"]) for ds in ("alpaca", "qa") for r in load_eval_set(ds)[1:3]}
    assert kept == want and part["methods"]["ar"]["overall"]["questions"] == 4

    run("qa", tmp_path / "c", new=4)
    with pytest.raises(ValueError, match="settings differ"):
        em.merge([tmp_path / "a", tmp_path / "c"], tmp_path / "bad")
    # results.json describes a folder's last run only: the records' own settings are compared too
    shutil.copy(tmp_path / "a" / "results.json", tmp_path / "c" / "results.json")
    with pytest.raises(ValueError, match="records' settings differ"):
        em.merge([tmp_path / "a", tmp_path / "c"], tmp_path / "bad")
    # a question answered in two inputs comes from the last, as `poss eval` resuming a folder reads it
    first = json.loads((tmp_path / "a" / "records.jsonl").read_text().splitlines()[0])
    again = tmp_path / "a2"
    again.mkdir()
    shutil.copy(tmp_path / "a" / "results.json", again / "results.json")
    redone = {**first, "answered_again": True}
    (again / "records.jsonl").write_text(json.dumps(redone) + "\n")
    em.merge([tmp_path / "a", again], tmp_path / "redo")
    merged = [json.loads(line) for line in (tmp_path / "redo" / "records.jsonl").read_text().splitlines()]
    same_q = [r for r in merged if (r["method"], r["dataset"], r["question_id"])
              == (first["method"], first["dataset"], first["question_id"])]
    assert [r.get("answered_again") for r in same_q] == [True]
    assert len(merged) == len((tmp_path / "a" / "records.jsonl").read_text().splitlines())
    # a question id the packaged set does not hold is named, not a KeyError
    with open(tmp_path / "b" / "records.jsonl", "a") as f:
        f.write(json.dumps({"method": "ar", "dataset": "qa", "question_id": "nope", "turns": []}) + "\n")
    with pytest.raises(ValueError, match="question 'nope'"):
        em.merge([tmp_path / "a", tmp_path / "b"], tmp_path / "bad", questions=(0, 2))


def test_question_range_covers_every_packaged_set_and_refuses_a_custom_one(tmp_path):
    """``--questions`` cuts the extra packaged sets too (humaneval164), and a set it cannot place is an
    error naming it, never a silently empty report."""
    from poss.data.eval_sets import EXTRA_SETS, load_eval_set
    from poss.eval import merge as em

    for name in EXTRA_SETS:
        pos = em.question_positions(name)
        assert pos is not None and sorted(pos.values()) == list(range(len(load_eval_set(name))))
    run = tmp_path / "custom"
    run.mkdir()
    (run / "results.json").write_text(json.dumps({"settings": {"depth": 2}, "machine": {"threads": 1}}))
    (run / "records.jsonl").write_text(json.dumps({"method": "ar", "dataset": "my_set", "question_id": 0,
                                                   "turns": []}) + "\n")
    with pytest.raises(ValueError, match="'my_set', not a packaged set"):
        em.merge([run], tmp_path / "out", questions=(0, 1))
