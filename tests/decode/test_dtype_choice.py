"""``dtype="auto"`` for a GGUF target (poss.decode.dtype_choice): which format it picks from timings, the
cache (hit, a new layout or thread count measures again, retune), targets with nothing to time, and
poss.load with it (an explicit dtype times nothing). The timer is always a stand-in: no test depends on
how fast anything ran."""

import pytest
import torch

from helpers.gguf_files import write_gguf
from helpers.loop import single_thread, tiny_target  # noqa: F401  (autouse: one CPU thread)
from poss.decode import dtype_choice
from poss.decode.dtype_choice import GGUF, VERIFY_ROWS, choose_dtype, decide, float_candidates

pytest.importorskip("gguf")

FLOAT = float_candidates()[0]  # what auto is without blocks on this CPU


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A fresh cache, and a quiet machine (the busy warning is tested on its own)."""
    from poss import hardware

    monkeypatch.setenv("POSS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hardware, "others_load", lambda: 0.0)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return write_gguf(tiny_target(), tmp_path_factory.mktemp("gguf") / "tiny.gguf", layers="q4_0", head="q8_0")


class Timer:
    """A stand-in for :func:`dtype_choice.measure`: fixed ms per candidate and rows, calls counted."""

    def __init__(self, ms):
        self.ms, self.calls = ms, []

    def __call__(self, layout, candidates, float_dtype, rows):
        self.calls.append((layout.fingerprint, tuple(candidates), float_dtype))
        self.rows = tuple(rows)
        # a verify of other rows than VERIFY_ROWS costs what VERIFY_ROWS does here
        return {c: {r: self.ms[c].get(r, self.ms[c][VERIFY_ROWS]) for r in rows} for c in candidates}


# gguf wins a one-row step, a float dtype wins the tree verify (as on a CPU with AMX)
SPLIT = {GGUF: {1: 20.0, VERIFY_ROWS: 120.0}, "bfloat16": {1: 40.0, VERIFY_ROWS: 60.0},
         "float32": {1: 80.0, VERIFY_ROWS: 100.0}}


def test_decide_weighs_one_row_without_a_draft_and_the_verify_rows_with_one():
    assert decide(SPLIT, draft=False) == (GGUF, 1)
    assert decide(SPLIT, draft=True) == ("bfloat16", VERIFY_ROWS)
    tie = {"bfloat16": {1: 5.0, VERIFY_ROWS: 5.0}, GGUF: {1: 5.0, VERIFY_ROWS: 5.0}}
    assert decide(tie, draft=False)[0] == "bfloat16"  # a tie keeps the float dtype


def test_candidates_are_auto_float_fp32_and_the_blocks(gguf_file):
    timer = Timer(SPLIT | {FLOAT: SPLIT["bfloat16"]})
    choose_dtype(gguf_file, draft=False, timer=timer)
    ((_, candidates, float_dtype),) = timer.calls
    assert candidates == tuple(dict.fromkeys([FLOAT, "float32"])) + (GGUF,)
    assert float_dtype == getattr(torch, FLOAT)  # the gguf run's activations and other weights


def test_first_use_measures_and_logs_then_the_cache_answers(gguf_file, capsys):
    timer = Timer(SPLIT)
    first = choose_dtype(gguf_file, draft=False, timer=timer)
    assert (first.dtype, first.source, first.rows) == (GGUF, "measured", 1)
    err = capsys.readouterr().err
    assert "timing the target's weights as" in err and "dtype auto: gguf (measured: gguf 20.0" in err
    again = choose_dtype(gguf_file, draft=False, timer=timer)
    assert (again.dtype, again.source) == (GGUF, "cached") and len(timer.calls) == 1
    assert capsys.readouterr().err == ""  # a cached answer is silent
    # The cache holds the timings, not the answer: a speculative load decides on the verify rows.
    spec = choose_dtype(gguf_file, draft=True, timer=timer)
    assert (spec.dtype, spec.rows, spec.source) == (FLOAT, VERIFY_ROWS, "cached")
    assert len(timer.calls) == 1
    assert spec.label().startswith(f"{spec.dtype} (cached: ") and f"at {VERIFY_ROWS} rows" in spec.label()


def test_a_tree_of_other_rows_is_timed_at_its_own_rows(gguf_file):
    timer = Timer(SPLIT)
    choose_dtype(gguf_file, draft=True, timer=timer)
    assert timer.rows == (1, VERIFY_ROWS)
    wide = choose_dtype(gguf_file, draft=True, verify_rows=24, timer=timer)
    assert (wide.source, wide.rows, timer.rows) == ("measured", 24, (1, 24))
    assert choose_dtype(gguf_file, draft=True, verify_rows=24, timer=timer).source == "cached"
    with pytest.raises(ValueError, match="verify_rows must be an int >= 2"):
        choose_dtype(gguf_file, draft=True, verify_rows=1, timer=timer)


def test_retune_measures_again_and_replaces_the_cache(gguf_file):
    timer = Timer(SPLIT)
    assert choose_dtype(gguf_file, draft=False, timer=timer).dtype == GGUF
    faster_floats = {c: {r: (200.0 if c == GGUF else 10.0) for r in (1, VERIFY_ROWS)} for c in SPLIT}
    timer.ms = faster_floats
    assert choose_dtype(gguf_file, draft=False, timer=timer).source == "cached"
    retuned = choose_dtype(gguf_file, draft=False, retune=True, timer=timer)
    assert retuned.source == "measured" and retuned.dtype != GGUF and len(timer.calls) == 2
    assert choose_dtype(gguf_file, draft=False, timer=timer).dtype == retuned.dtype  # the new timings stay


def test_another_thread_count_or_target_layout_measures_again(gguf_file, tmp_path):
    timer = Timer(SPLIT)
    choose_dtype(gguf_file, draft=False, timer=timer)
    saved = torch.get_num_threads()
    torch.set_num_threads(saved + 1)
    try:
        assert choose_dtype(gguf_file, draft=False, timer=timer).source == "measured"
    finally:
        torch.set_num_threads(saved)
    assert choose_dtype(gguf_file, draft=False, timer=timer).source == "cached"
    other = write_gguf(tiny_target(), tmp_path / "other.gguf", layers="q8_0", head="q8_0")  # same shapes
    assert choose_dtype(other, draft=False, timer=timer).source == "measured"
    assert len({fp for fp, _, _ in timer.calls}) == 2 and len(timer.calls) == 3


def test_nothing_is_timed_without_blocks_poss_runs(tmp_path):
    def never(*a):
        raise AssertionError("timed")

    f16 = write_gguf(tiny_target(), tmp_path / "f16.gguf", layers="f16", head="q8_0")  # only the head in blocks
    for choice in (choose_dtype(f16, draft=True, timer=never), choose_dtype(None, draft=True, timer=never),
                   choose_dtype(f16, draft=True, device="cuda", timer=never)):
        assert choice.ms == {} and choice.dtype in ("bfloat16", "float32")
    assert choose_dtype(f16, draft=False, timer=never).dtype == FLOAT
    assert "no Q8_0/Q4_0/Q4_1" in choose_dtype(f16, draft=False, timer=never).label()


def test_the_timer_runs_every_candidate_at_both_row_counts(gguf_file):
    """The real timer on the tiny file (tiny sample): a time per candidate and row count, scaled to
    every layer. Only the shape of the answer is checked, never a time."""
    from poss.models.gguf_weights import gguf_linear_layout

    layout = gguf_linear_layout(gguf_file)
    for c in (FLOAT, GGUF):
        ms = dtype_choice.time_format(layout, c, getattr(torch, FLOAT), repeats=1, sample=1 << 16)
        assert set(ms) == {1, VERIFY_ROWS} and all(v > 0 for v in ms.values())


def test_fused_matrices_follow_the_runner(gguf_file, tmp_path):
    from poss.models.gguf_weights import gguf_linear_layout

    layer = dtype_choice.fused_matrices(gguf_linear_layout(gguf_file), 1)
    cfg = tiny_target().config
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.hidden_size // cfg.num_attention_heads
    assert [(m.n, m.k, m.format) for m in layer] == [
        (qkv, cfg.hidden_size, "q4_0"), (cfg.hidden_size, cfg.hidden_size, "q4_0"),
        (2 * cfg.intermediate_size, cfg.hidden_size, "q4_0"), (cfg.hidden_size, cfg.intermediate_size, "q4_0")]
    head = dtype_choice.head_matrix(gguf_linear_layout(gguf_file))
    assert (head.n, head.format) == (cfg.vocab_size, "q8_0")


# -- poss.load ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An HF folder of the tiny target with the values its GGUF file decodes to, the file, and a PosS
    draft (reduced vocabulary) made for it."""
    from helpers.train_tiny import byte_tokenizer
    from poss.models.target import TargetRunner
    from poss.testing import random_draft

    root = tmp_path_factory.mktemp("gguf_target")
    model = tiny_target(vocab=300)
    path = write_gguf(model, root / "tiny.gguf", layers="q4_0", head="q8_0")
    tok = byte_tokenizer()
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    random_draft(TargetRunner(model, max_batch=1, max_seq=64), n=3, ppl=2, aligned=True, draft_vocab=240).save(
        root / "draft")
    return root, path


@pytest.fixture
def as_gguf_target(folder, monkeypatch):
    """poss.load of the folder behaves as for a .gguf target: the file is its GGUF file."""
    import poss.decode.loader as loader
    import poss.models.registry as registry

    root, path = folder
    monkeypatch.setattr(loader, "local_gguf", lambda target: path)
    monkeypatch.setattr(registry, "gguf_file", lambda target: path)
    return root


def test_load_auto_runs_what_the_timing_picked(as_gguf_target, monkeypatch):
    import poss
    from poss.cli.generate import speed_line

    monkeypatch.setattr(dtype_choice, "measure", Timer(SPLIT | {FLOAT: SPLIT["bfloat16"]}))
    plain = poss.load(as_gguf_target / "target", dtype="auto")
    assert plain.dtype_choice.dtype == GGUF and plain.runner.quantized
    assert plain.runner.weight_formats() == {"q4_0": 8, "q8_0": 1}
    line = speed_line(plain.generate([[5, 6, 7]], 4), plain)
    assert "; dtype gguf (measured: gguf 20.0" in line
    spec = poss.load(as_gguf_target / "target", draft=as_gguf_target / "draft", dtype="auto")
    assert spec.dtype_choice.dtype == FLOAT and spec.dtype_choice.source == "cached"
    assert not spec.runner.quantized and spec.runner.dtype == getattr(torch, FLOAT)
    # A fixed tree is timed at the rows it verifies (num_nodes + lookup).
    from poss.decode.params import TreeParams

    fixed = poss.load(as_gguf_target / "target", draft=as_gguf_target / "draft", dtype="auto",
                      tree=TreeParams(num_nodes=10, depth=3, lookup=4))
    assert dtype_choice.measure.rows == (1, 14) and fixed.dtype_choice.rows == 14


def test_an_explicit_dtype_times_nothing(as_gguf_target, monkeypatch):
    import poss

    def never(*a):
        raise AssertionError("timed")

    monkeypatch.setattr(dtype_choice, "measure", never)
    for dtype in ("gguf", "float32", torch.float32):
        gen = poss.load(as_gguf_target / "target", dtype=dtype)
        assert gen.dtype_choice is None and gen.runner.quantized == (dtype == "gguf")


def test_a_gguf_target_keeps_the_draft_float_and_speculation_equals_its_ar_loop(as_gguf_target):
    """Through poss.load: the target on the file's q4_0 / q8_0 blocks, the PosS draft (reduced vocabulary)
    in the float dtype with its head on the gathered q8_0 rows; greedy speculation token-identical to
    the AR loop on the same blocks."""
    import poss
    from poss.decode.params import TreeParams
    from poss.testing import eval_prompts

    spec = poss.load(as_gguf_target / "target", draft=as_gguf_target / "draft", dtype="gguf",
                     tree=TreeParams(num_nodes=12, depth=4), speculate_max_batch=None)
    ar = poss.load(as_gguf_target / "target", dtype="gguf")
    assert {p.dtype for p in spec.draft.parameters()} == {getattr(torch, FLOAT)}
    assert spec.draft._head_blocks.file_format == "q8_0"
    prompts = eval_prompts(n_per_set=1)
    res = spec.generate(prompts, 40)
    assert res.token_ids == ar.generate(prompts, 40).token_ids
    assert max(k for s in res.stats for k, c in enumerate(s.accept_hist) if c) >= 2  # trees really verified


def test_poss_info_lists_the_cached_choices_without_timing(gguf_file, capsys):
    import json
    from types import SimpleNamespace

    from poss.cli import info

    assert info.dtype_auto() == {"float": FLOAT, "gguf_targets_timed": []}
    choose_dtype(gguf_file, draft=False, timer=Timer(SPLIT))
    capsys.readouterr()
    assert info.run(SimpleNamespace()) == 0
    shown = json.loads(capsys.readouterr().out)["dtype_auto"]
    (entry,) = shown["gguf_targets_timed"]
    assert entry["target"] == "tiny.gguf" and entry["threads"] == torch.get_num_threads()
    assert (entry["plain"], entry["speculative"]) == (GGUF, FLOAT)
    assert entry["ms"][GGUF] == {str(r): v for r, v in SPLIT[GGUF].items()}  # JSON keys are strings


def test_the_cli_passes_auto_and_gguf_through_to_poss_load():
    from types import SimpleNamespace

    from poss.cli.args import model_dtype

    assert model_dtype(SimpleNamespace(dtype="auto")) == "auto"
    assert model_dtype(SimpleNamespace(dtype="gguf")) == "gguf"
    assert model_dtype(SimpleNamespace(dtype="float32")) == torch.float32


def test_a_busy_machine_warns_and_the_load_is_kept_with_the_timings(gguf_file, monkeypatch):
    import json

    from poss import hardware

    monkeypatch.setattr(hardware, "others_load", lambda: 99.0)
    monkeypatch.setattr(hardware, "load_average", lambda: 99.5)
    with pytest.warns(RuntimeWarning, match=r"dtype auto: the machine is busy \(load average 99.5.*--retune"):
        choose_dtype(gguf_file, draft=False, timer=Timer(SPLIT))
    (path,) = dtype_choice.cache_dir().glob("*.json")
    assert json.loads(path.read_text())["load_average"] == 99.5
