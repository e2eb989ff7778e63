"""``poss tune``: time this machine for a target and draft now (the draft tree ``auto`` picks and, with
``--max-batch``, the batch size above which speculation stops paying), within a time budget, and cache it.

Nothing else times on its own: ``auto`` uses this cache, else the tree shipped with the draft for this CPU
class and dtype. On a busy machine the timings would mislead, so ``tune`` refuses unless ``--force``.
"""

import sys

from poss.cli.args import (
    Formatter,
    add_datastore,
    add_draft,
    add_draft_vocab,
    add_dtype,
    add_target,
    add_threads,
    check_model,
    float_in,
    int_at_least,
)


def add_parser(sub):
    p = sub.add_parser("tune", help="time draft tree sizes on this machine now (about a minute; what `auto` uses)",
                       formatter_class=Formatter)
    add_target(p)
    add_draft(p)
    add_dtype(p, "run")
    add_threads(p)
    add_datastore(p)
    add_draft_vocab(p)
    p.add_argument("--budget", type=float_in(1), default=60.0, help="seconds to spend at most, about")
    p.add_argument("--max-batch", type=int_at_least(1), default=None,
                   help="also time where speculation stops paying, up to this batch (poss serve's --max-batch)")
    p.add_argument("--force", action="store_true", help="time even while other work holds the cores")
    return p


def run(args) -> int:
    check_model(args)
    from poss.cli.args import chosen_draft, model_dtype
    from poss.decode.autotune import MachineBusy, busy_reason, tune
    from poss.decode.loader import load
    from poss.hardware import default_threads

    reason = None if args.force else busy_reason(args.threads or default_threads())
    if reason is not None:  # before loading the model: it would not be timed
        print(f"poss tune: {reason}; not timing; --force times anyway", file=sys.stderr)
        return 1
    gen = load(args.target, draft=chosen_draft(args, "poss tune"), dtype=model_dtype(args),
               datastore=args.datastore, draft_vocab=args.draft_vocab, threads=args.threads or "auto")
    try:
        print(f"poss tune: {tune(gen, budget_s=args.budget, force=args.force, max_batch=args.max_batch)}",
              file=sys.stderr)
    except MachineBusy as e:
        print(f"poss tune: {e}; --force times anyway", file=sys.stderr)
        return 1
    return 0
