"""A first answer in seconds: ``tree="auto"`` and ``speculate_max_batch="auto"`` never time on their own
(this machine's cached timing, else the draft's tree shipped for the CPU class and dtype, else a
fallback); timing runs only when asked (``autotune.tune``), within its budget, and not on a busy
machine; the default thread count follows the free cores."""

import json
import time

import pytest

from helpers.loop import (
    eval_prompts,
    hf_greedy,
    make_generator,
    single_thread,  # noqa: F401  (autouse: one CPU thread)
    tiny_target,
)
from poss import hardware
from poss.decode import autotune, shipped_trees
from poss.decode.cost_model import Calibration
from poss.decode.params import TreeParams, tree_spec
from poss.models.registry import DRAFTS_DIR

PROMPTS = eval_prompts(1, max_len=24)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture
def gen(target, tmp_path, monkeypatch):
    """A drafted generator on an empty timing cache, whose every timing path fails the test."""
    monkeypatch.setenv("POSS_CACHE", str(tmp_path / "cache"))
    for name in ("time_configs", "measure_batches", "run_greedy"):
        monkeypatch.setattr(autotune, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} ran unasked"))
    return make_generator(target, draft=True, n=3, ppl=2, aligned=True)


def ship(folder, entries):
    folder.mkdir(exist_ok=True)
    (folder / shipped_trees.FILE).write_text(json.dumps({"trees": entries}))
    return folder


def test_auto_answers_with_the_tree_shipped_for_this_machine_and_times_nothing(gen, target, tmp_path):
    key = shipped_trees.machine_class(gen.runner.device, gen.runner.dtype)
    gen.draft_dir = ship(tmp_path / "draft", {key: {"tree": "3/1+2", "speculate_max_batch": 2, "source": "test"},
                                              "other/float32": {"tree": "60/6", "source": "not this machine"}})
    gen.default_tree, gen.speculate_max_batch = "auto", "auto"
    res = gen.generate(PROMPTS[:3], 16)
    assert res.tree == TreeParams(num_nodes=3, depth=1, lookup=2)
    assert gen.auto_choice.source == f"shipped for {key}"
    assert gen.speculation_limit(res.tree) == 2
    assert res.token_ids == [hf_greedy(target, p, 16) for p in PROMPTS[:3]]
    assert gen.resolve_tree("auto", beam_width=4) == TreeParams(num_nodes=3, depth=1, beam_width=4, lookup=2)


def test_a_machine_with_no_shipped_entry_gets_the_fallback(gen, tmp_path):
    gen.draft_dir = ship(tmp_path / "draft", {"no-such-cpu/float32": {"tree": "60/6", "source": "x"}})
    fallback = shipped_trees.FALLBACK["cpu"]
    assert gen.auto_tree() == fallback.tree and gen.auto_choice.source == fallback.source
    gen.speculate_max_batch = "auto"
    assert gen.speculation_limit(fallback.tree) == fallback.speculate_max_batch
    gen.draft_dir = None  # a draft with no folder (built in memory)
    gen.forget_tuning()
    assert gen.auto_tree() == fallback.tree


def test_a_cached_timing_wins_over_the_shipped_tree(gen, tmp_path):
    gen.draft_dir = ship(tmp_path / "draft", {shipped_trees.machine_class(gen.runner.device, gen.runner.dtype):
                                              {"tree": "3/1", "source": "test"}})
    cal = Calibration({1: 10.0, 8: 10.5, 16: 11.0}, [(8, 3, 1.0), (16, 3, 1.5)], [0.9] * 3)
    path = autotune.cache_path(autotune.cache_key(gen))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(cal.to_json()))
    assert autotune.auto_tree(gen) == (autotune.choose(cal), "timed on this machine")
    assert autotune.choose(cal) != tree_spec("3/1")


@pytest.mark.parametrize("text,error", [("{", "not a trees file"), ('{"trees": {"K": {"tree": "3"}}}', "bad entry"),
                                         ('{"trees": {"K": {"tree": "3/1", "speculate_max_batch": 0}}}',
                                          r"bad entry 'K' \(speculate_max_batch")])
def test_a_broken_trees_file_is_a_clear_error(tmp_path, monkeypatch, text, error):
    import torch

    monkeypatch.setattr(shipped_trees, "machine_class", lambda device, dtype: "K")
    (tmp_path / shipped_trees.FILE).write_text(text)
    with pytest.raises(ValueError, match=rf"trees.json: {error}"):
        shipped_trees.shipped_tree(tmp_path, torch.device("cpu"), torch.float32)


def test_every_shipped_trees_file_parses_and_names_its_source():
    files = sorted(DRAFTS_DIR.glob(f"*/{shipped_trees.FILE}"))
    assert files, "no draft ships a trees.json"
    classes = {"avx512-bf16", "avx512", "avx2", "other", "cuda"}
    for f in files:
        for key, entry in json.loads(f.read_text())["trees"].items():
            kind, dtype = key.split("/")
            assert kind in classes and dtype in ("bfloat16", "float32", "float16"), (f, key)
            assert tree_spec(entry["tree"]).depth >= 1 and entry["source"].strip(), (f, key)


def test_cpu_classes():
    assert hardware.cpu_class(frozenset({"avx2", "fma", "avx512f", "avx512_bf16"})) == "avx512-bf16"
    assert hardware.cpu_class(frozenset({"avx2", "fma", "amx_bf16"})) == "avx512-bf16"
    assert hardware.cpu_class(frozenset({"avx2", "fma", "avx512f"})) == "avx512"
    assert hardware.cpu_class(frozenset({"avx2", "fma"})) == "avx2"
    assert hardware.cpu_class(frozenset({"avx2"})) == hardware.cpu_class(frozenset()) == "other"


# -- timing on request ---------------------------------------------------------------------------
def busy(monkeypatch, cores, others):
    monkeypatch.setattr(hardware, "usable_cores", lambda: cores)
    monkeypatch.setattr(hardware, "others_load", lambda: others)


def test_tune_refuses_on_a_busy_machine_and_changes_nothing(gen, monkeypatch, tmp_path):
    busy(monkeypatch, 2, 1.9)
    with pytest.raises(autotune.MachineBusy, match=r"busy: other work keeps 1.9 of its 2 cores busy"):
        autotune.tune(gen)
    assert not (tmp_path / "cache").exists()


def test_tune_times_within_its_budget_and_auto_then_uses_it(gen, monkeypatch):
    busy(monkeypatch, 2, 0.2)
    asked = []

    def fake_calibrate(g, refresh=False, budget_s=None, **kw):
        asked.append(budget_s)
        cal = Calibration({1: 10.0, 2: 10.1, 4: 10.2}, [(2, 1, 0.5), (4, 1, 0.5)], [0.8],
                          key={**autotune.cache_key(g), "n_prompts": 2, "n_more_prompts": 1, "seconds": 40.0})
        path = autotune.cache_path(autotune.cache_key(g))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cal.to_json()))
        return cal

    monkeypatch.setattr(autotune, "calibrate", fake_calibrate)
    gen.draft_dir = None
    assert gen.auto_tree() == shipped_trees.FALLBACK["cpu"].tree  # nothing timed yet
    line = autotune.tune(gen, budget_s=30)
    assert asked == [30] and "timed 2 + 1 prompts in 40 s" in line
    assert gen.auto_choice is None  # the generator forgot its earlier choice
    gen.auto_tree()
    assert gen.auto_choice.source == "timed on this machine"
    with pytest.raises(ValueError, match="budget_s"):
        autotune.tune(gen, budget_s=0)


def test_no_prompt_starts_past_the_deadline(target):
    g = make_generator(target, draft=True, n=3, ppl=2, aligned=True)
    configs = [(1, 0), (4, 1)]
    *_, timed = autotune.time_configs(g, PROMPTS[:3], 4, configs, deadline=time.perf_counter())
    assert timed == 1
    *_, counts, timed = autotune.time_configs(g, PROMPTS[:3], 4, configs)
    assert timed == 3 and all(n == 3 * 3 for n, _, _ in counts.values())  # 3 prompts x 3 tokens after the first


def test_busy_reason_counts_the_cores_a_timing_needs(monkeypatch):
    busy(monkeypatch, 2, 0.9)
    assert autotune.busy_reason(1) is None and "busy" in autotune.busy_reason(2)
    busy(monkeypatch, 16, 3.0)
    assert autotune.busy_reason(8) is None and "busy" in autotune.busy_reason(14)


@pytest.mark.parametrize("cores,others,want", [(2, 0.0, 2), (2, 0.4, 2), (2, 0.6, 1), (2, 1.2, 1), (2, 7.5, 1),
                                               (16, 3.4, 13), (1, 0.0, 1)])
def test_default_threads_are_the_free_cores(monkeypatch, cores, others, want):
    busy(monkeypatch, cores, others)
    assert hardware.default_threads() == want


def test_load_threads_auto_lowers_to_the_free_cores_and_keeps_a_lower_choice(monkeypatch):
    import torch

    from poss.decode.loader import set_threads

    saved = torch.get_num_threads()
    try:
        busy(monkeypatch, 2, 1.2)  # one core free
        torch.set_num_threads(2)
        set_threads("auto")
        assert torch.get_num_threads() == 1
        busy(monkeypatch, 2, 0.0)
        set_threads("auto")  # the caller's (here: the step above's) lower count stays
        assert torch.get_num_threads() == 1
        set_threads(2)
        assert torch.get_num_threads() == 2
        set_threads(None)
        set_threads(1, device="cuda")  # a GPU run leaves the CPU threads alone
        assert torch.get_num_threads() == 2
        for bad in (0, -1, True, 1.5, "many"):
            with pytest.raises(ValueError, match="threads must be"):
                set_threads(bad)
    finally:
        torch.set_num_threads(saved)


def test_the_stats_line_names_the_tree_auto_chose_and_the_threads(gen, tmp_path):
    import torch

    from poss.cli.generate import speed_line as _speed_line

    gen.draft_dir = None
    res = gen.generate(PROMPTS[:1], 8, tree="auto")
    line = _speed_line(res, gen)
    assert f"tree 2/1 (auto: {shipped_trees.FALLBACK['cpu'].source})" in line
    assert line.endswith(f"; {torch.get_num_threads()} thread]")  # the autouse fixture: one thread
    fixed = gen.generate(PROMPTS[:1], 8, tree=TreeParams(6, 2))
    assert "; tree 6/2" in _speed_line(fixed, gen) and "auto" not in _speed_line(fixed, gen)


def test_the_tune_command(monkeypatch, capsys):
    from poss.cli import build_parser
    from poss.cli import tune as cli

    args = build_parser().parse_args(["tune", "--budget", "30", "--max-batch", "4", "--threads", "1"])
    busy(monkeypatch, 2, 0.0)
    seen = {}
    monkeypatch.setattr("poss.decode.loader.load", lambda *a, **kw: seen.update(kw) or "GEN")
    monkeypatch.setattr(autotune, "tune", lambda g, **kw: seen.update(kw, gen=g) or "tree 4/1 (timed)")
    assert cli.run(args) == 0 and "poss tune: tree 4/1 (timed)" in capsys.readouterr().err
    assert seen["gen"] == "GEN" and seen["budget_s"] == 30 and seen["max_batch"] == 4 and seen["threads"] == 1

    def refuse(g, **kw):
        raise autotune.MachineBusy("the machine is busy")

    monkeypatch.setattr(autotune, "tune", refuse)
    assert cli.run(args) == 1 and "busy; --force times anyway" in capsys.readouterr().err
    busy(monkeypatch, 2, 1.9)  # refused before the model loads
    seen.clear()
    assert cli.run(args) == 1 and "busy" in capsys.readouterr().err and not seen


def test_others_busy_now_sees_another_process_but_not_this_one():
    import subprocess
    import sys
    import threading
    import time

    if hardware.others_busy_now(0.05) is None:
        pytest.skip("no /proc/stat here")
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        time.sleep(0.3)
        assert hardware.others_busy_now(0.5) >= 0.6  # one core spinning in another process
    finally:
        spin.kill()
        spin.wait()
    stop = time.monotonic() + 0.8
    own = threading.Thread(target=lambda: [None for _ in iter(lambda: time.monotonic() > stop, True)])
    own.start()
    try:
        busy_own = hardware.others_busy_now(0.5)  # this process's own spinning thread is not "others"
    finally:
        own.join()
    assert busy_own < 0.6 + hardware.others_busy_now(0.3)
