"""``poss tune``: time this machine for a target and draft now (the draft tree ``auto`` picks and the batch
size above which speculation stops paying), replacing any cached timings, and print what was chosen."""

import json

from poss.cli.args import (
    Formatter,
    add_beam_width,
    add_draft,
    add_dtype,
    add_target,
    add_threads,
    check_model,
    set_threads,
)


def add_parser(sub):
    p = sub.add_parser("tune", help="time the draft tree and batch limit for this machine now (what `auto` uses)",
                       formatter_class=Formatter)
    add_target(p)
    add_draft(p)
    add_dtype(p, "run")
    add_threads(p)
    add_beam_width(p)
    return p


def run(args) -> int:
    check_model(args)
    set_threads(args)
    from poss.cli.args import chosen_draft
    from poss.decode.loader import load
    from poss.hardware import resolve_dtype

    # retune: the cached timings go first, so both choices below are measured now, not read back.
    gen = load(args.target, draft=chosen_draft(args, "poss tune"), dtype=resolve_dtype(args.dtype, "cpu"),
               retune=True, speculate_max_batch="auto")
    tree = gen.auto_tree(args.beam_width)
    limit = gen.speculation_limit(tree)
    print(json.dumps({"num_nodes": tree.num_nodes, "depth": tree.depth, "beam_width": tree.beam_width,
                      "lookup": tree.lookup, "speculate_max_batch": limit}, indent=1))
    return 0
