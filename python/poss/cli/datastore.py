"""``poss datastore build``: a lookup datastore (``--datastore FILE``) from ``poss distill`` folders."""

from pathlib import Path

from poss.cli.args import Formatter, UsageError


def add_parser(sub):
    p = sub.add_parser("datastore", help="build the lookup datastore that --lookup draws on",
                       formatter_class=Formatter)
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    b = actions.add_parser("build", formatter_class=Formatter,
                           help="a datastore of the training answers of `poss distill` folders (held-out answers "
                                "left out; the longest answer per prompt)")
    b.add_argument("folders", nargs="+", metavar="FOLDER",
                   help="poss distill output folders (records.jsonl or records.jsonl.xz, meta.json), all made by "
                        "the same target")
    b.add_argument("--out", required=True, help="the .npz to write (e.g. python/poss/data/datastores/TARGET.npz)")
    return p


def run(args) -> int:
    from poss.decode.datastore_build import build_datastore

    for folder in args.folders:
        if not (Path(folder) / "meta.json").is_file():
            raise UsageError(f"FOLDER: {folder!r} has no meta.json (expected a `poss distill` output folder)")
    if not args.out.endswith(".npz"):
        raise UsageError(f"--out: expected a file name ending in .npz, got {args.out!r}")
    store = build_datastore(args.folders)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    store.save(out)
    print(f"{out}: {store.meta['documents']:,} answers, {len(store):,} tokens, {out.stat().st_size / 2**20:.1f} MiB")
    return 0
