"""``poss eval``: methods side by side on the benchmark sets (results.json, table.md and plots in --out), or
``--merge`` the folders of several such runs into one report."""

import argparse
import sys
from pathlib import Path
from typing import Tuple

from poss.cli.args import (
    Formatter,
    UsageError,
    add_dtype,
    add_sampling,
    add_target,
    add_threads,
    add_tree,
    check_draft,
    check_target,
    int_at_least,
    set_threads,
)

# The flags a --merge reads; every other one belongs to a run and is refused beside --merge.
MERGE_FLAGS = ("merge", "out", "questions")


def add_parser(sub):
    p = sub.add_parser("eval", help="tau, pos-acc and speedup of drafts on the benchmark sets",
                       formatter_class=Formatter)
    add_target(p)
    p.add_argument("--drafts", nargs="*", default=None, metavar="DIR",
                   help="draft folders to compare (default: the target's shipped drafts)")
    p.add_argument("--datasets", default="all",
                   help="comma-separated set names, 'all', or 'none' (only --dataset files)")
    p.add_argument("--dataset", action="append", default=[], metavar="FILE",
                   help="a custom JSONL set (records with 'turns'); repeatable")
    p.add_argument("--limit", type=int_at_least(1), default=None, help="the first K questions of each set")
    p.add_argument("--shard", type=shard_arg, default=(0, 1), metavar="I/N",
                   help="answer only the questions at positions I, I+N, I+2N, ... of each set (after --limit), "
                        "so N processes share the cores; join their folders with --merge")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=512, help="answer length per turn at most")
    p.add_argument("--turns", type=int_at_least(1), default=None,
                   help="ask only the first K turns of each question (MT-Bench has 2; default: all)")
    # The paper's comparison runs fixed trees, so a fixed chain length too: no "auto" here.
    add_tree(p, auto=False, vocab_help="; with full, each method is named DRAFT+full-vocab")
    add_sampling(p, filters=False, seed_default=0)
    p.add_argument("--hf", action="store_true", help="also time transformers generate (greedy) as a reference")
    add_threads(p)
    add_dtype(p, "run")
    p.add_argument("--out", required=True, help="results folder (resumes when it already holds records); with "
                                                "--merge, the merged folder")
    m = p.add_argument_group("merging runs (instead of running)")
    m.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                   help="merge these `poss eval --out` folders (e.g. the --shard runs) into --out: their records "
                        "and one report; a question answered in several comes from the last")
    m.add_argument("--questions", type=questions_arg, default=None, metavar="A:B",
                   help="with --merge: keep the questions at positions A..B-1 (0-based) of each packaged set")
    p.set_defaults(run_defaults={a.dest: a.default for a in p._actions
                                 if a.option_strings and a.dest not in MERGE_FLAGS + ("help",)})
    return p


def shard_arg(text: str) -> Tuple[int, int]:
    """``I/N`` -> (I, N) with 0 <= I < N."""
    i, _, n = text.partition("/")
    try:
        i, n = int(i), int(n)
    except ValueError:
        i = n = None
    if i is None or not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"expected I/N with integers 0 <= I < N, e.g. 0/2, got {text!r}")
    return i, n


def questions_arg(text: str) -> Tuple[int, int]:
    """``A:B`` -> (A, B) with 0 <= A < B."""
    a, _, b = text.partition(":")
    try:
        a, b = int(a), int(b)
    except ValueError:
        a = b = None
    if a is None or not 0 <= a < b:
        raise argparse.ArgumentTypeError(f"expected A:B with integers 0 <= A < B, e.g. 0:40, got {text!r}")
    return a, b


def run_merge(args) -> int:
    from poss.eval.merge import merge

    given = sorted("--" + dest.replace("_", "-") for dest, default in args.run_defaults.items()
                   if getattr(args, dest) != default)
    if given:
        raise UsageError(f"--merge reads only --out and --questions; {', '.join(given)} belong to a run "
                         "(the settings come from the merged folders)")
    for d in args.merge:
        if not (Path(d) / "results.json").is_file():
            raise UsageError(f"--merge: {d!r} holds no results.json (expected a `poss eval --out` folder)")
    merge(args.merge, Path(args.out), args.questions)
    print((Path(args.out) / "table.md").read_text())
    return 0


def _check(args) -> None:
    """Every check that needs no model or data: raises ``UsageError`` naming the flag."""
    check_target(args.target)
    for d in args.drafts or []:
        check_draft(d, "--drafts")
    for f in args.dataset:
        if not Path(f).is_file():
            raise UsageError(f"--dataset: no such file {f!r} (expected a JSONL file)")


def run(args) -> int:
    if args.merge is not None:
        return run_merge(args)
    if args.questions is not None:
        raise UsageError("--questions needs --merge (it picks the questions of the merged folders)")
    from poss.data.eval_sets import EVAL_SETS, EXTRA_SETS, load_eval_set

    if args.datasets in ("all", "none"):
        names = list(EVAL_SETS) if args.datasets == "all" else []
    else:
        names = [n for n in args.datasets.split(",") if n]
    unknown = [n for n in names if n not in EVAL_SETS + EXTRA_SETS]
    if unknown:
        raise UsageError(f"--datasets: unknown set(s) {unknown}; known: {', '.join(EVAL_SETS + EXTRA_SETS)}")
    _check(args)
    from poss.eval.report import write
    from poss.eval.run import ResumeConflict, Settings, evaluate
    from poss.hardware import resolve_dtype

    datasets = {n: load_eval_set(n) for n in names}
    datasets.update({Path(f).stem: load_eval_set(f) for f in args.dataset})
    set_threads(args)
    drafts = args.drafts
    if drafts is None:
        from poss.models.registry import shipped_drafts

        drafts = [str(d) for d in shipped_drafts(args.target)]
    methods = [None] + (["hf"] if args.hf else []) + list(drafts)
    s = Settings(args.max_new_tokens, args.num_nodes, args.depth, args.beam_width, args.temperature, args.seed,
                 args.turns, args.lookup, args.draft_vocab)
    if args.dtype == "gguf":
        raise UsageError("--dtype gguf: poss eval runs float targets (auto, float32, bfloat16, float16); "
                         "time the GGUF blocks with poss generate or bench/bench_qlinear.py")
    dtype = resolve_dtype(args.dtype, "cpu")
    try:
        evaluate(args.target, methods, datasets, args.out, s, dtype=dtype, limit=args.limit,
                 shard=args.shard)
    except ResumeConflict as e:
        raise UsageError(f"--out: {e}") from None
    res = write(args.out, args.depth, vars(s), args.threads, dtype)
    print((Path(args.out) / "table.md").read_text())
    same = {n: m["identical"] for n, m in res["methods"].items() if n not in ("ar", "hf")}
    if args.temperature == 0 and any(a != b for a, b in same.values()):
        import poss_ext

        why = (f"; poss.linear runs the vendor GEMM for {dtype} on this CPU, which rounds a tree forward and a "
               "single-token step differently, so greedy paths can part at near-ties of the logits"
               if poss_ext.ops.cpu_linear_kernel(dtype) == "aten" else "")
        print(f"poss eval: output differs from autoregressive decoding: {same}{why}", file=sys.stderr)
        return 1
    return 0
