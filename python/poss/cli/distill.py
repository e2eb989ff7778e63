"""``poss distill``: the target's own greedy answers (and their features) as draft-training data."""

import json
import sys
from pathlib import Path

from poss.cli.args import (
    Formatter,
    UsageError,
    add_dtype,
    add_target,
    add_threads,
    check_target,
    int_at_least,
    set_threads,
)


def add_parser(sub):
    p = sub.add_parser("distill", help="write the target's own greedy answers (+ features) as draft-training data",
                       formatter_class=Formatter)
    add_target(p)
    p.add_argument("--prompts", type=int_at_least(1), default=4000, help="training prompts")
    p.add_argument("--val-prompts", type=int_at_least(0), default=100, help="held-out prompts (answered first)")
    p.add_argument("--out", required=True, help="data folder: records.jsonl, features/, meta.json")
    p.add_argument("--batch-size", type=int_at_least(1), default=32,
                   help="answers decoded together (continuous batching: a finished row takes the next prompt)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=384, help="answer length at most")
    p.add_argument("--max-prompt-tokens", type=int_at_least(1), default=384, help="longer prompts are skipped")
    p.add_argument("--seed", type=int, default=0, help="prompt selection seed")
    p.add_argument("--prompt-source", choices=("sharegpt", "sharegpt-code"), default="sharegpt",
                   help="ShareGPT first turns, or only its coding requests (HumanEval and GSM8K problems excluded)")
    add_dtype(p, "data")
    add_threads(p)
    p.add_argument("--rebuild-features", action="store_true",
                   help="generate nothing: compute the target features of the records in --out that have none "
                        "(a data set restored from its shipped token ids)")
    return p


def run(args) -> int:
    check_target(args.target)
    if args.rebuild_features and not (Path(args.out) / "records.jsonl").is_file():
        raise UsageError(f"--out: {args.out!r} has no records.jsonl to rebuild the features of (expected a "
                         "`poss distill` folder, e.g. one restored from its shipped records.jsonl.xz)")
    import torch

    from poss.decode.loader import load
    from poss.train.data import load_sharegpt
    from poss.train.distill import distill

    set_threads(args)
    if args.rebuild_features:
        from poss.train.distill import features_dtype, rebuild_features

        dtype = args.dtype or features_dtype(args.out) or "float32"
        print(f"features in {dtype}", file=sys.stderr)
        gen = load(args.target, draft=None, dtype=getattr(torch, dtype))
        print(f"features computed for {rebuild_features(gen.runner, args.out)} records", file=sys.stderr)
        return 0
    gen = load(args.target, draft=None, dtype=getattr(torch, args.dtype or "float32"))
    convs = load_sharegpt()
    meta = distill(gen, convs.messages, args.out, args.prompts, args.val_prompts, args.batch_size,
                   args.max_new_tokens, args.max_prompt_tokens, args.seed, prompt_source=args.prompt_source)
    print(json.dumps(meta, indent=1))
    return 0
