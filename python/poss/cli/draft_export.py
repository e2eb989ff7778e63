"""``poss export``: a poss draft written in a published layout (EAGLE-1/2 and HASS, the PosS reference, EAGLE-3)."""

from poss.cli.args import Formatter, UsageError, add_target, check_draft, float_in


def add_parser(sub):
    p = sub.add_parser("export", formatter_class=Formatter, help="write a poss draft in a published layout")
    p.add_argument("draft", metavar="DRAFT", help="a poss draft folder")
    p.add_argument("--format", required=True, choices=("eagle", "poss-ref", "eagle3"),
                   help="eagle: EAGLE-1/2 and HASS (SGLang, vLLM, the EAGLE code); poss-ref: the PosS "
                        "reference code; eagle3: EAGLE-3 drafts")
    p.add_argument("--out", required=True, help="folder to write to")
    add_target(p, default=None, what="the draft's target, to write its embedding (embed_tokens.weight; poss-ref "
                                     "needs it) and context length: ")
    p.add_argument("--file-format", choices=("safetensors", "bin"), default="safetensors",
                   help="model.safetensors or pytorch_model.bin")
    p.add_argument("--shard-mb", type=float_in(0, low_open=True), default=None,
                   help="split the weights into shards of at most this many MB")
    return p


def run(args) -> int:
    from poss.cli.draft_import import float32_target
    from poss.models.draft_interop import export_draft

    check_draft(args.draft, "DRAFT")
    if args.format == "poss-ref" and args.target is None:
        raise UsageError("--format poss-ref needs --target (the reference loads embed_tokens.weight strictly)")
    embed, positions = None, 2048
    if args.target is not None:
        runner, model = float32_target(args.target)
        embed, positions = runner.embed, int(getattr(model.config, "max_position_embeddings", 2048))
    files = export_draft(args.draft, args.format, args.out, embed=embed, file_format=args.file_format,
                         max_shard_bytes=None if args.shard_mb is None else int(args.shard_mb * 2**20),
                         max_positions=positions)
    print(f"wrote {len(files)} files to {args.out}")
    return 0
