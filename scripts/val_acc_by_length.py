"""Held-out accuracy of drafts over the first N tokens of each answer: where in an answer acc@k comes from.

    python scripts/val_acc_by_length.py drafts/poss2 --answer-tokens 128 0

Scores the held-out split of a `poss distill` records file (the shipped `records.jsonl.xz` is read as
is) the way training validates (``poss.train.validate.evaluate``: top-1 agreement at draft steps
1..``--steps``, later steps on the draft's own features), once per answer-prefix length (0: whole
answers, which is what a draft's config.json reports; a prefix is laid out as training lays out an
answer cut there, ``poss.train.distill.record_example``). Long answers of a small target repeat
themselves, and repeats are easy to draft, so the whole-answer figure can sit well above what the
first tokens of an answer, or a short generation, will accept.
"""

import argparse
import sys
from pathlib import Path

import torch


def main(argv=None) -> int:
    import poss
    from poss.hardware import resolve_dtype
    from poss.jsonl import read_jsonl
    from poss.models.draft import PosSDraft
    from poss.train.distill import record_example
    from poss.train.features import make_features
    from poss.train.objective import Objective
    from poss.train.validate import evaluate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafts", nargs="+", help="draft folders")
    ap.add_argument("--records", type=Path, default=Path("data/distill-smollm2-135m-bf16/records.jsonl.xz"),
                    help="a `poss distill` records.jsonl (or .jsonl.xz)")
    ap.add_argument("--answer-tokens", type=int, nargs="+", default=[128, 0], help="prefix lengths; 0 = whole answers")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    records = sorted((r for r in read_jsonl(a.records) if r["split"] == "val"), key=lambda r: r["key"])
    if not records:
        raise SystemExit(f"--records {a.records}: no held-out ('val') records")
    dtype = resolve_dtype(a.dtype)
    gen = poss.load(a.target, dtype=dtype)
    longest = max(len(r["prompt_ids"]) + len(r["answer_ids"]) for r in records)
    gen.runner.cache = gen.runner.cache.grown(1, longest)  # one example per forward, the longest whole
    features = make_features(gen.runner)
    print(f"| draft | answer tokens | rows | acc@1..{a.steps} |")
    print("|---|---|---|---|")
    for d in a.drafts:
        draft = PosSDraft.load(d, dtype=torch.float32)
        for n in a.answer_tokens:
            ex = [record_example(r, answer_tokens=n) for r in records]
            res = evaluate(draft, features, ex, list(range(len(ex))), Objective(steps=a.steps), gen.runner)
            print(f"| {d} | {n or 'all'} | {res['tokens']} | {' / '.join(f'{x:.3f}' for x in res['acc'])} |",
                  flush=True)
    print(f"\n{len(records)} held-out answers of {a.records}, target in {dtype}, {a.threads} thread(s).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
