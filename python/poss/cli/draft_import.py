"""``poss import``: a published EAGLE / HASS / PosS / EAGLE-3 draft converted once into poss's format."""

from poss.cli.args import Formatter, UsageError, add_target, int_at_least


def add_parser(sub):
    p = sub.add_parser("import", formatter_class=Formatter,
                       help="convert a published EAGLE / HASS / PosS / EAGLE-3 draft into poss's format")
    p.add_argument("folder", metavar="FOLDER", help="the published draft (config.json + weights)")
    add_target(p, required=True, what="the target it was made for: ")
    p.add_argument("--out", required=True, help="folder to write the poss draft and its model card to")
    p.add_argument("--positions-per-specialist", type=int_at_least(1), default=None,
                   help="positions each layer drafts (the PosS reference's --position_per_layer), "
                        "where config.json does not say")
    return p


def float32_target(target):
    """``(runner, hf_model)`` of ``target`` in float32 (the dtype drafts record fingerprints in)."""
    import torch

    from poss.models.registry import load_model
    from poss.models.target import TargetRunner

    _, model = load_model(target, dtype=torch.float32)
    return TargetRunner(model, max_batch=1, max_seq=8, huge_pages=False), model


def run(args) -> int:
    from pathlib import Path

    from poss.models.draft_interop import import_draft

    if not (Path(args.folder) / "config.json").is_file():
        raise UsageError(f"FOLDER {args.folder!r} has no config.json (expected a published draft folder)")
    runner, _ = float32_target(args.target)
    out = import_draft(args.folder, runner, args.out, str(args.target), args.positions_per_specialist)
    print(f"wrote {out} (model card: {out / 'README.md'})")
    return 0
