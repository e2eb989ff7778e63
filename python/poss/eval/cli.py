"""``poss eval``: methods side by side on the benchmark sets; results.json, table.md and plots in --out."""

import argparse
import sys
from pathlib import Path


def add_eval_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("eval", help="tau, pos-acc and speedup of drafts on the benchmark sets",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="registry name, HF folder or .gguf")
    p.add_argument("--drafts", nargs="*", default=None, metavar="DIR",
                   help="draft folders to compare (default: the target's shipped drafts)")
    p.add_argument("--datasets", default="all", help="comma-separated set names, 'all', or 'none' (only --dataset files)")
    p.add_argument("--dataset", action="append", default=[], metavar="FILE",
                   help="a custom JSONL set (records with 'turns'); repeatable")
    p.add_argument("--limit", type=int, default=None, help="the first K questions of each set")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--num-nodes", type=int, default=60)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--beam-width", type=int, default=10, help="draft candidates kept per tree level (EAGLE's top-k)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; 1: the sampling setting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf", action="store_true", help="also time transformers generate (greedy) as a reference")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True, help="results folder (resumes when it already holds records)")
    return p


def _check(args) -> str:
    if args.limit is not None and args.limit < 1:
        return f"--limit must be >= 1, got {args.limit}"
    if args.max_new_tokens < 1:
        return f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"
    if args.temperature < 0:
        return f"--temperature must be >= 0, got {args.temperature}"
    if args.depth < 1 or args.num_nodes < 2:
        return f"--depth must be >= 1 and --num-nodes >= 2, got {args.depth} and {args.num_nodes}"
    for d in args.drafts or []:
        if not (Path(d) / "config.json").is_file():
            return f"--drafts: {d!r} is not a draft folder (no config.json)"
    for f in args.dataset:
        if not Path(f).is_file():
            return f"--dataset: no such file {f!r}"
    return ""


def run_eval(args) -> int:
    err = _check(args)
    if err:
        print(f"poss eval: {err}", file=sys.stderr)
        return 2
    import torch

    from poss.data.eval_sets import EVAL_SETS, load_eval_set
    from poss.eval.report import write
    from poss.eval.run import Settings, evaluate

    if args.datasets in ("all", "none"):
        names = list(EVAL_SETS) if args.datasets == "all" else []
    else:
        names = [n for n in args.datasets.split(",") if n]
    unknown = [n for n in names if n not in EVAL_SETS]
    if unknown:
        print(f"poss eval: --datasets: unknown set(s) {unknown}; known: {', '.join(EVAL_SETS)}", file=sys.stderr)
        return 2
    datasets = {n: load_eval_set(n) for n in names}
    datasets.update({Path(f).stem: load_eval_set(f) for f in args.dataset})
    if args.threads:
        torch.set_num_threads(args.threads)
    drafts = args.drafts
    if drafts is None:
        from poss.models.registry import shipped_drafts

        drafts = [str(d) for d in shipped_drafts(args.target)]
    methods = [None] + (["hf"] if args.hf else []) + list(drafts)
    s = Settings(args.max_new_tokens, args.num_nodes, args.depth, args.beam_width, args.temperature, args.seed)
    evaluate(args.target, methods, datasets, args.out, s, limit=args.limit)
    res = write(args.out, args.depth, vars(s), args.threads)
    print((Path(args.out) / "table.md").read_text())
    same = {n: m["identical"] for n, m in res["methods"].items() if n not in ("ar", "hf")}
    if args.temperature == 0 and any(a != b for a, b in same.values()):
        print(f"poss eval: output differs from autoregressive decoding: {same}", file=sys.stderr)
        return 1
    return 0
