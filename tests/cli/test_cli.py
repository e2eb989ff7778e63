"""The ``poss`` command line a newcomer meets: every bad input is one line on stderr naming the flag,
exit status 2, no traceback, checked before any model is loaded; chat survives Ctrl-C; help shows
defaults and the registry targets; ``poss --help`` imports no torch."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from poss.cli import main
from poss.cli.args import registry_names

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_model_loading(monkeypatch, request):
    """Fail loudly if a bad-input test reaches the model loader (the checks must come first)."""
    if "tiny_target_folder" in request.fixturenames:  # the tests that load a (tiny) model on purpose
        return
    import poss.decode.loader
    import poss.models.registry

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(poss.decode.loader, "load", refuse)
    monkeypatch.setattr(poss.models.registry, "load_model", refuse)


def fails(argv, flag, capsys, text=None):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    # transformers' own "Loading weights" progress bar may precede the error when a model was loaded
    lines = [line for line in err.strip().splitlines() if "Loading weights" not in line]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"poss {argv[0]}: "), err
    assert flag in lines[0], err
    assert text is None or text in lines[0], err
    assert "no trained draft" not in err
    return lines[0]


@pytest.fixture
def draft_files(tmp_path):
    """A file, a folder without weights, and a folder with a truncated model.safetensors."""
    import torch
    from safetensors.torch import save_file

    f = tmp_path / "draft.txt"
    f.write_text("not a folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "config.json").write_text("{}")
    save_file({"w": torch.zeros(64, 64)}, str(cut / "model.safetensors"))
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    return f, empty, cut


# -- poss generate / chat -------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", ["generate", "chat"])
@pytest.mark.parametrize("bad,flag", [
    (["--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--top-p", "2"], "--top-p"),
    (["--top-k", "-1"], "--top-k"),
    (["--min-p", "2"], "--min-p"),
    (["--num-nodes", "0"], "--num-nodes"),
    (["--num-nodes", "many"], "--num-nodes"),
    (["--depth", "deep"], "--depth"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--threads", "0"], "--threads"),
    (["--dtype", "float64"], "--dtype"),
    (["--depth", "-1"], "--depth"),
    (["--beam-width", "0"], "--beam-width"),
    (["--depth", "30", "--beam-width", "10"], "--depth"),  # a tree over the kernel's limits
    (["--lookup", "-1"], "--lookup"),
    (["--num-nodes", "60", "--lookup", "197"], "--lookup"),  # 60 + 197 nodes: over the kernel's 256
])
def test_generate_bad_numbers(cmd, bad, flag, capsys):
    fails([cmd] + (["--prompt", "hi"] if cmd == "generate" else []) + bad, flag, capsys)


def test_tree_flags_default_to_auto_and_a_size_alone_takes_the_fixed_rest():
    from poss.cli import build_parser
    from poss.decode.params import TreeParams, tree_from_flags

    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert (args.num_nodes, args.depth) == ("auto", "auto")
    assert tree_from_flags("auto", "auto", 10) == "auto"
    assert tree_from_flags(16, "auto", 8) == TreeParams(num_nodes=16, depth=6, beam_width=8)
    assert tree_from_flags("auto", 3, 10) == TreeParams(num_nodes=60, depth=3)
    assert tree_from_flags(3, 1, 10, lookup=4) == TreeParams(num_nodes=3, depth=1, lookup=4)


def test_lookup_alone_runs_on_a_tiny_folder(tiny_target_folder, capsys):
    assert main(["generate", "--no-draft", "--lookup", "4", "--target", str(tiny_target_folder), "--prompt",
                 "hi hi hi", "--max-new-tokens", "8", "--threads", "1"]) == 0
    assert "tokens/s" in capsys.readouterr().err


def test_lookup_with_a_datastore_file_and_a_foreign_one(tiny_target_folder, tmp_path, capsys):
    from poss.decode.datastore import Datastore

    base = ["generate", "--no-draft", "--lookup", "4", "--target", str(tiny_target_folder), "--prompt", "hi",
            "--max-new-tokens", "8", "--threads", "1", "--datastore"]
    Datastore.from_documents([[5, 6, 7, 8]], meta={"target_fingerprint": "0123456789abcdef"}).save(tmp_path / "x.npz")
    fails(base + [str(tmp_path / "x.npz")], "poss generate", capsys, "made by target weights 0123456789abcdef")
    fails(base + [str(tmp_path / "missing.npz")], "poss generate", capsys, "datastore: no file")
    Datastore.from_documents([[5, 6, 7, 8]]).save(tmp_path / "any.npz")  # no fingerprint recorded: taken as given
    assert main(base + [str(tmp_path / "any.npz")]) == 0
    assert main(base + ["none"]) == 0


@pytest.mark.parametrize("flag,value", [("--top-p", "0.9"), ("--top-k", "5"), ("--min-p", "0.1")])
def test_sampling_filters_need_a_temperature(flag, value, capsys):
    fails(["generate", "--prompt", "hi", flag, value], flag, capsys, "--temperature > 0")
    fails(["generate", "--prompt", "hi", "--temperature", "0", flag, value], flag, capsys, "--temperature > 0")


def test_draft_missing_file_empty_or_truncated(draft_files, tmp_path, capsys):
    f, empty, cut = draft_files
    fails(["generate", "--prompt", "hi", "--draft", str(tmp_path / "nowhere")], "--draft", capsys, "does not exist")
    fails(["generate", "--prompt", "hi", "--draft", str(f)], "--draft", capsys, "is a file")
    fails(["generate", "--prompt", "hi", "--draft", str(empty)], "--draft", capsys, "model.safetensors")
    line = fails(["chat", "--draft", str(cut)], "model.safetensors", capsys, "truncated")
    assert str(cut / "model.safetensors") in line


def test_unknown_target_lists_the_registry_and_no_draft_notice(capsys):
    line = fails(["generate", "--prompt", "hi", "--target", "no-such-model"], "--target", capsys)
    for name in registry_names():
        assert name in line


def test_truncated_target_weights_name_the_file(draft_files, capsys):
    _, _, cut = draft_files  # a folder with config.json and a truncated model.safetensors
    line = fails(["generate", "--prompt", "hi", "--no-draft", "--target", str(cut)], "model.safetensors", capsys,
                 "truncated")
    assert str(cut / "model.safetensors") in line


def test_draft_and_no_draft(tmp_path, capsys):
    fails(["generate", "--prompt", "hi", "--draft", str(tmp_path), "--no-draft"], "--no-draft", capsys)


def test_debug_shows_the_traceback():
    from poss.cli.args import UsageError

    with pytest.raises(UsageError):
        main(["--debug", "generate", "--prompt", "hi", "--top-p", "2"])


def test_registry_names_match_the_registry():
    from poss.models.registry import REGISTRY

    assert registry_names() == tuple(REGISTRY)


@pytest.fixture(scope="module")
def tiny_target_folder(tmp_path_factory):
    """A tiny random Llama (context 64) with a ChatML byte tokenizer, saved as an HF folder."""
    from helpers.train_tiny import byte_tokenizer
    from poss.testing import tiny_target

    root = tmp_path_factory.mktemp("cli") / "target"
    model = tiny_target(vocab=300, max_position_embeddings=64)
    tok = byte_tokenizer()
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return root


def test_prompt_over_the_context_is_one_line(tiny_target_folder, capsys):
    fails(["generate", "--no-draft", "--target", str(tiny_target_folder), "--prompt", "x" * 200,
           "--max-new-tokens", "4", "--threads", "1", "--dtype", "float32"], "--prompt", capsys, "context")


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t"])
def test_an_empty_prompt_is_refused_naming_the_flag(prompt, capsys):
    line = fails(["generate", "--prompt", "hi", "--prompt", prompt], "--prompt", capsys, "non-empty")
    assert ("an empty one" if not prompt else "only whitespace") in line


@pytest.mark.parametrize("flag,value,want", [
    ("--num-nodes", "0", "expected an integer in [1, 256] or 'auto', got '0'"),
    ("--depth", "deep", "expected an integer >= 0 or 'auto', got 'deep'"),
    ("--speculate-max-batch", "0", "expected an integer >= 1 or 'auto' or 'off', got '0'"),
])
def test_auto_flags_say_what_they_expect(flag, value, want, capsys):
    fails(["generate", "--prompt", "hi", flag, value], flag, capsys, want)


def test_a_prompt_over_the_context_is_refused_before_the_weights_load(tiny_target_folder, monkeypatch, capsys):
    """Only the tokenizer and config are read: the generator and the model weights are never loaded."""
    import transformers

    import poss.decode.loader
    import poss.models.registry

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the prompt length was checked")

    monkeypatch.setattr(poss.decode.loader, "load", refuse)
    monkeypatch.setattr(poss.models.registry, "load_model", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    line = fails(["generate", "--no-draft", "--target", str(tiny_target_folder), "--prompt", "ok",
                  "--prompt", "x" * 200], "--prompt 2", capsys, "context of 64 tokens")
    assert "shorten it" in line


def test_generate_runs_on_a_tiny_folder(tiny_target_folder, capsys):
    assert main(["generate", "--no-draft", "--target", str(tiny_target_folder), "--prompt", "hi",
                 "--max-new-tokens", "4", "--threads", "1"]) == 0
    assert "tokens/s" in capsys.readouterr().err


# -- chat: Ctrl-C and Ctrl-D ------------------------------------------------------------------------

class FakeResult:
    def __init__(self, text):
        self.texts = [text]
        self.stats = []


class FakeGen:
    """Streams 'a', 'b', 'c'; raises KeyboardInterrupt after ``interrupt_after`` pieces when set."""

    context_limit = 1000

    def __init__(self):
        self.seen = []
        self.interrupt_after = None
        self.closed = 0

    def encode(self, messages):
        return [0] * sum(len(m["content"]) for m in messages)

    def stream(self, messages, **options):
        self.seen.append([dict(m) for m in messages])
        try:
            for i, piece in enumerate("abc"):
                if self.interrupt_after is not None and i == self.interrupt_after:
                    self.interrupt_after = None
                    raise KeyboardInterrupt
                yield piece
            self.last_result = FakeResult("abc")
        except GeneratorExit:
            self.closed += 1
            raise


def lines(*items):
    """An input function returning ``items`` in turn; an exception class is raised instead."""
    it = iter(items)

    def read(prompt=""):
        item = next(it)
        if isinstance(item, type) and issubclass(item, BaseException):
            raise item
        return item

    return read


def run_chat(gen, read, capsys):
    from poss.cli.chat import chat_loop

    rc = chat_loop(gen, {}, read=read, speed=lambda *a: "[speed]")
    return rc, capsys.readouterr()


def test_chat_ctrl_c_at_the_prompt_exits_cleanly(capsys):
    gen = FakeGen()
    rc, out = run_chat(gen, lines("hello", KeyboardInterrupt), capsys)
    assert rc == 0 and out.out.endswith("\n") and "Traceback" not in out.err
    assert gen.seen == [[{"role": "user", "content": "hello"}]]


def test_chat_ctrl_d_ends_with_a_newline(capsys):
    rc, out = run_chat(FakeGen(), lines(EOFError), capsys)
    assert rc == 0 and out.out == "\n"


def test_chat_ctrl_c_during_an_answer_returns_to_the_prompt_with_the_conversation(capsys):
    gen = FakeGen()
    gen.interrupt_after = None
    read = lines("first", "second", "third", EOFError)
    orig_stream = gen.stream
    calls = {"n": 0}

    def stream(messages, **options):
        calls["n"] += 1
        if calls["n"] == 2:  # the second answer is interrupted after one piece
            gen.interrupt_after = 1
        return orig_stream(messages, **options)

    gen.stream = stream
    rc, out = run_chat(gen, read, capsys)
    assert rc == 0
    assert "[answer stopped]" in out.err and "Traceback" not in out.err
    assert gen.seen[2] == [{"role": "user", "content": "first"}, {"role": "assistant", "content": "abc"},
                           {"role": "user", "content": "second"}, {"role": "assistant", "content": "a"},
                           {"role": "user", "content": "third"}]


def test_chat_message_over_the_context_is_reported_and_dropped(capsys):
    gen = FakeGen()
    gen.context_limit = 10
    rc, out = run_chat(gen, lines("x" * 20, "ok", ""), capsys)
    assert rc == 0 and "context" in out.err
    assert gen.seen == [[{"role": "user", "content": "ok"}]]


# -- train / distill / eval / serve -----------------------------------------------------------------

@pytest.mark.parametrize("bad,flag", [
    (["--steps", "-3"], "--steps"), (["--epochs", "0"], "--epochs"), (["--batch-size", "0"], "--batch-size"),
    (["--lr", "-1"], "--lr"), (["--draft-vocab", "-5"], "--draft-vocab"), (["--max-len", "0"], "--max-len"),
    (["--positions-per-specialist", "0"], "--positions-per-specialist"), (["--threads", "0"], "--threads"),
    (["--target", "nope"], "--target"), (["--init-from", "nowhere"], "--init-from"), (["--data", "nowhere"], "--data"),
    (["--train-start", "-1"], "--train-start"), (["--train-start", "5"], "--train-start"),  # the latter without --data
    (["--feature-weight", "-1"], "--feature-weight"), (["--token-weight", "0"], "--token-weight"),
    (["--method", "eagle2", "--feature-weight", "0"], "--feature-weight"),  # one step: untrained inputs after it
    (["--device", "tpu"], "--device"),
])
def test_train_bad_inputs(bad, flag, tmp_path, capsys):
    fails(["train", "--out", str(tmp_path / "run")] + bad, flag, capsys)


@pytest.mark.parametrize("bad,flag", [
    (["--prompts", "0"], "--prompts"), (["--val-prompts", "-1"], "--val-prompts"),
    (["--batch-size", "0"], "--batch-size"),
    (["--max-new-tokens", "0"], "--max-new-tokens"), (["--max-prompt-tokens", "-2"], "--max-prompt-tokens"),
    (["--threads", "0"], "--threads"), (["--target", "nope"], "--target"),
    (["--rebuild-features"], "--out"),  # no records.jsonl there to rebuild the features of
])
def test_distill_bad_inputs(bad, flag, tmp_path, capsys):
    fails(["distill", "--out", str(tmp_path / "d")] + bad, flag, capsys)


@pytest.mark.parametrize("bad,flag", [
    (["--limit", "0"], "--limit"), (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--num-nodes", "0"], "--num-nodes"),
    (["--depth", "0"], "--depth"), (["--beam-width", "0"], "--beam-width"), (["--temperature", "-1"], "--temperature"),
    (["--threads", "0"], "--threads"), (["--dtype", "int8"], "--dtype"), (["--target", "nope"], "--target"),
    (["--drafts", "nowhere"], "--drafts"), (["--dataset", "nowhere.jsonl"], "--dataset"),
    (["--datasets", "nope"], "--datasets"),
])
def test_eval_bad_inputs(bad, flag, tmp_path, capsys):
    fails(["eval", "--out", str(tmp_path / "e")] + bad, flag, capsys)


@pytest.mark.parametrize("bad,flag", [
    (["--port", "70000"], "--port"), (["--port", "-1"], "--port"), (["--max-batch", "0"], "--max-batch"),
    (["--max-queue", "-1"], "--max-queue"), (["--num-nodes", "0"], "--num-nodes"), (["--threads", "0"], "--threads"),
    (["--target", "nope"], "--target"), (["--draft", "nowhere"], "--draft"),
    (["--speculate-max-batch", "0"], "--speculate-max-batch"),
    (["--speculate-max-batch", "never"], "--speculate-max-batch"),
    (["--lookup", "-2"], "--lookup"),
    (["--device", "gpu"], "--device"), (["--device", "cuda:x"], "--device"),
    (["--depth", "30", "--beam-width", "10"], "--depth"),  # a tree over the kernel's limits, before loading
])
def test_serve_bad_inputs(bad, flag, capsys):
    fails(["serve"] + bad, flag, capsys)


@pytest.mark.parametrize("bad,flag", [
    (["--threads", "0"], "--threads"), (["--target", "nope"], "--target"), (["--budget", "0"], "--budget"),
    (["--draft", "x", "--no-draft"], "--no-draft"), (["--max-batch", "0"], "--max-batch"),
])
def test_tune_bad_inputs(bad, flag, capsys):
    fails(["tune"] + bad, flag, capsys)


def test_tune_times_within_its_budget(monkeypatch, capsys):
    """poss tune loads the pair and times it with the budget and batch limit asked for."""
    seen = {}
    monkeypatch.setattr("poss.decode.autotune.busy_reason", lambda threads: None)
    monkeypatch.setattr("poss.decode.loader.load", lambda target, **kw: seen.update(kw) or "GEN")
    monkeypatch.setattr("poss.decode.autotune.tune",
                        lambda gen, **kw: seen.update(gen=gen, **kw) or "tree 4/2+3 (timed)")
    assert main(["tune", "--no-draft", "--budget", "30", "--max-batch", "4"]) == 0
    assert seen["gen"] == "GEN" and seen["budget_s"] == 30.0 and seen["max_batch"] == 4 and seen["draft"] is None
    assert "tree 4/2+3 (timed)" in capsys.readouterr().err


def test_tune_refuses_a_busy_machine_before_loading(monkeypatch, capsys):
    monkeypatch.setattr("poss.decode.autotune.busy_reason", lambda threads: "2 other processes hold the cores")

    def no_load(*a, **k):
        raise AssertionError("loaded the model on a busy machine")

    monkeypatch.setattr("poss.decode.loader.load", no_load)
    assert main(["tune", "--no-draft"]) == 1
    assert "hold the cores" in capsys.readouterr().err


def test_unknown_option_is_one_line(capsys):
    fails(["generate", "--prompt", "hi", "--bogus"], "--bogus", capsys)


# -- help ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", ["generate", "chat", "train", "distill", "eval", "serve", "tune"])
def test_help_shows_defaults_and_registry_targets(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name in registry_names():
        assert name in out
    assert "(default: smollm2-135m)" in out
    if cmd in ("generate", "chat"):
        for text in ("--threads", "(default: 256)", "(default: auto)", "(default: 1.0)"):
            assert text in out


def subcommands(parser):
    """``{name: parser}`` of a parser's sub-commands (none when it has none)."""
    import argparse

    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def every_parser(parser, prefix=()):
    """``(words, parser)`` for every command and nested action (``datastore build``, ``release draft``)."""
    for name, sub in subcommands(parser).items():
        yield prefix + (name,), sub
        yield from every_parser(sub, prefix + (name,))


def test_the_dispatch_table_covers_every_command():
    from poss.cli import build_parser
    from poss.cli.main import COMMANDS, command_module

    assert set(subcommands(build_parser())) == set(COMMANDS)
    for name in COMMANDS:
        module = command_module(name)
        assert callable(module.add_parser) and callable(module.run), name
        assert module.__name__.startswith("poss.cli."), name


def test_every_option_has_a_help_text():
    from poss.cli import build_parser

    for words, sub in every_parser(build_parser()):
        missing = [a.option_strings for a in sub._actions if a.option_strings and not a.help]
        assert not missing, words


def test_shared_flags_are_declared_once_and_library_packages_hold_no_cli():
    """--target, --dtype, --draft, --threads and the tree and sampling flags come from poss/cli/args.py, so
    their spelling, checks and choices cannot drift apart per command (--seed and --draft-vocab mean other
    things in train and distill: a seed of the data or weights, the K of a vocabulary to train); no library
    package parses arguments."""
    import re

    package = ROOT / "python" / "poss"
    for flag in ("--target", "--dtype", "--draft", "--no-draft", "--threads", "--device", "--temperature",
                 "--top-p", "--beam-width", "--num-nodes", "--depth", "--lookup", "--datastore",
                 "--speculate-max-batch"):
        where = [f.name for f in sorted((package / "cli").glob("*.py"))
                 if re.search(rf"add_argument\(\s*\"{flag}\"", f.read_text())]
        assert where == ["args.py"], (flag, where)
    for f in package.rglob("*.py"):
        if "cli" not in f.relative_to(package).parts:
            assert "argparse" not in f.read_text(), f


def test_dtype_choices_are_one_list_per_meaning():
    from poss.cli import build_parser
    from poss.cli.args import DTYPES

    lists = {}
    for words, sub in every_parser(build_parser()):
        for a in sub._actions:
            if "--dtype" in a.option_strings:
                lists.setdefault(tuple(a.choices), []).append(words[0])
    assert set(lists) == {choices for choices, _, _ in DTYPES.values()}
    assert sorted(lists[DTYPES["run"][0]]) == ["chat", "eval", "generate", "serve", "tune"]


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "hi"], ["chat"], ["train", "--out", "x"], ["distill", "--out", "x"],
    ["eval", "--out", "x"], ["eval", "--out", "x", "--merge", "a", "b"], ["serve"], ["tune"], ["info"], ["demo"],
    ["datastore", "build", "a", "--out", "x.npz"], ["release", "draft", "runs/x"], ["release", "data", "a", "b"],
])
def test_every_command_parses_its_minimal_line(argv):
    from poss.cli import build_parser

    args = build_parser().parse_args(argv)
    assert args.command == argv[0]


def test_poss_help_imports_no_torch():
    code = ("import sys; from poss.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "try:\n    main(['generate', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))))")
    env_path = f"{ROOT}:{ROOT / 'python'}"
    r = subprocess.run([sys.executable, "-c", "import json\n" + code], capture_output=True, text=True,
                       env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []
