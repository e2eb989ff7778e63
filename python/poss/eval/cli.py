"""``poss eval``: methods side by side on the benchmark sets; results.json, table.md and plots in --out."""

import argparse
import sys
from pathlib import Path
from typing import Tuple

from poss.cli_args import (
    DRAFT_VOCAB_HELP,
    LOOKUP_HELP_FIXED,
    Formatter,
    UsageError,
    check_draft,
    check_target,
    float_in,
    int_at_least,
    target_help,
)
from poss.models.draft_config import DRAFT_VOCABS


def add_eval_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("eval", help="tau, pos-acc and speedup of drafts on the benchmark sets",
                       formatter_class=Formatter)
    p.add_argument("--target", default="smollm2-135m", help=target_help())
    p.add_argument("--drafts", nargs="*", default=None, metavar="DIR",
                   help="draft folders to compare (default: the target's shipped drafts)")
    p.add_argument("--datasets", default="all",
                   help="comma-separated set names, 'all', or 'none' (only --dataset files)")
    p.add_argument("--dataset", action="append", default=[], metavar="FILE",
                   help="a custom JSONL set (records with 'turns'); repeatable")
    p.add_argument("--limit", type=int_at_least(1), default=None, help="the first K questions of each set")
    p.add_argument("--shard", type=shard_arg, default=(0, 1), metavar="I/N",
                   help="answer only the questions at positions I, I+N, I+2N, ... of each set (after --limit), "
                        "so N processes share the cores; merge their folders with scripts/eval_merge.py")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=512, help="answer length per turn at most")
    p.add_argument("--turns", type=int_at_least(1), default=None,
                   help="ask only the first K turns of each question (MT-Bench has 2; default: all)")
    p.add_argument("--num-nodes", type=int_at_least(2, 256), default=60,
                   help="tree nodes verified per round, root included")
    p.add_argument("--depth", type=int_at_least(1), default=6, help="draft positions below the root")
    p.add_argument("--beam-width", type=int_at_least(1), default=10,
                   help="draft candidates kept per tree level (EAGLE's top-k)")
    # The paper's comparison runs fixed trees, so a fixed chain length too: no "auto" here.
    p.add_argument("--lookup", type=int_at_least(0), default=0, help=LOOKUP_HELP_FIXED)
    p.add_argument("--draft-vocab", choices=DRAFT_VOCABS, default="trained",
                   help=DRAFT_VOCAB_HELP + "; with full, each method is named DRAFT+full-vocab")
    p.add_argument("--temperature", type=float_in(0), default=0.0, help="0: greedy; 1: the sampling setting")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--hf", action="store_true", help="also time transformers generate (greedy) as a reference")
    p.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="the models' dtype; auto: bfloat16 on CUDA or a CPU with AMX/AVX512-BF16, else float32")
    p.add_argument("--out", required=True, help="results folder (resumes when it already holds records)")
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


def _check(args) -> None:
    """Every check that needs no model or data: raises ``UsageError`` naming the flag."""
    check_target(args.target)
    for d in args.drafts or []:
        check_draft(d, "--drafts")
    for f in args.dataset:
        if not Path(f).is_file():
            raise UsageError(f"--dataset: no such file {f!r} (expected a JSONL file)")


def run_eval(args) -> int:
    from poss.data.eval_sets import EVAL_SETS, EXTRA_SETS, load_eval_set

    if args.datasets in ("all", "none"):
        names = list(EVAL_SETS) if args.datasets == "all" else []
    else:
        names = [n for n in args.datasets.split(",") if n]
    unknown = [n for n in names if n not in EVAL_SETS + EXTRA_SETS]
    if unknown:
        raise UsageError(f"--datasets: unknown set(s) {unknown}; known: {', '.join(EVAL_SETS + EXTRA_SETS)}")
    _check(args)
    import torch

    from poss.eval.report import write
    from poss.eval.run import ResumeConflict, Settings, evaluate
    from poss.hardware import resolve_dtype

    datasets = {n: load_eval_set(n) for n in names}
    datasets.update({Path(f).stem: load_eval_set(f) for f in args.dataset})
    if args.threads:
        torch.set_num_threads(args.threads)
    drafts = args.drafts
    if drafts is None:
        from poss.models.registry import shipped_drafts

        drafts = [str(d) for d in shipped_drafts(args.target)]
    methods = [None] + (["hf"] if args.hf else []) + list(drafts)
    s = Settings(args.max_new_tokens, args.num_nodes, args.depth, args.beam_width, args.temperature, args.seed,
                 args.turns, args.lookup, args.draft_vocab)
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
