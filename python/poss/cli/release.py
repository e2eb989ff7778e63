"""``poss release draft`` and ``poss release data``: what training made, copied into the repository with
its card (a trained draft into ``drafts/``, a ``poss distill`` data set's token ids into ``data/``)."""

import json
import sys
from pathlib import Path

from poss.cli.args import Formatter, UsageError, int_at_least


def add_parser(sub):
    p = sub.add_parser("release", help="copy a trained draft or a distilled data set into the repository, with "
                                       "its card", formatter_class=Formatter)
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    d = actions.add_parser("draft", formatter_class=Formatter,
                           help="a finished `poss train` run's fp16 draft, with a model card from its config and "
                                "its held-out validation")
    d.add_argument("run", metavar="RUN", help="the run folder (its --out), holding draft-fp16/")
    d.add_argument("--dest", default="drafts", help="the folder the draft goes into, as DEST/NAME")
    d.add_argument("--name", default=None, help="the released draft's name (default: the run folder's name)")
    d.add_argument("--steps", type=int_at_least(1), default=6,
                   help="the draft positions the card's held-out accuracy covers")
    d.add_argument("--validation", default=None, metavar="FILE",
                   help="the draft's held-out scores with the key they were scored under (default: "
                        "RUN/val-steps<STEPS>.json, which scripts/draft_report.py writes)")
    d.add_argument("--init", default=None, metavar="DIR",
                   help="the draft the run started from, for a config that does not record its --init-from")
    a = actions.add_parser("data", formatter_class=Formatter,
                           help="a `poss distill` folder's token ids (records.jsonl.xz), meta.json and data card")
    a.add_argument("folder", metavar="FOLDER", help="a poss distill --out folder")
    a.add_argument("out", metavar="OUT", help="the data folder to write (e.g. data/distill-smollm2-135m-bf16)")
    a.add_argument("--run", default="runs/distill", help="the folder the card's restore commands use")
    a.add_argument("--note", default="", help="a sentence on how the set was made (sessions, machine)")
    return p


def _release_draft(args) -> int:
    from poss.train.release import release_draft

    run = Path(args.run)
    if not (run / "draft-fp16" / "config.json").is_file():
        raise UsageError(f"RUN: {args.run!r} has no draft-fp16/config.json (expected a finished `poss train` "
                         "run folder)")
    path = Path(args.validation) if args.validation else run / f"val-steps{args.steps}.json"
    flag = "--validation" if args.validation else f"--validation (default {path})"
    if not path.is_file():
        raise UsageError(f"{flag}: no such file; score the draft first, e.g. `python scripts/draft_report.py "
                         f"{run.parent}` (it writes RUN/val-steps{args.steps}.json)")
    validation = json.loads(path.read_text())
    if "key" not in validation or len(validation.get("acc", ())) != args.steps:
        raise UsageError(f"{flag}: expected the held-out scores of {args.steps} positions with the key they were "
                         f"scored under, as scripts/draft_report.py writes them; {path} has "
                         f"{len(validation.get('acc', ()))} positions{'' if 'key' in validation else ' and no key'}")
    if args.init is not None and not (Path(args.init) / "config.json").is_file():
        raise UsageError(f"--init: {args.init!r} has no config.json (expected a draft folder)")
    out = release_draft(run, args.dest, validation, name=args.name, init_dir=args.init, steps=args.steps)
    print(f"released {out}", file=sys.stderr)
    return 0


def _release_data(args) -> int:
    from poss.train.release import release_data

    for name in ("meta.json", "records.jsonl"):
        if not (Path(args.folder) / name).is_file():
            raise UsageError(f"FOLDER: {args.folder!r} has no {name} (expected a `poss distill` output folder)")
    got = release_data(args.folder, args.out, run=args.run, note=args.note)
    print(f"{args.out}: {got['records']} records, {got['packed_bytes'] / 1e6:.2f} MB packed")
    return 0


ACTIONS = {"draft": _release_draft, "data": _release_data}


def run(args) -> int:
    return ACTIONS[args.action](args)
