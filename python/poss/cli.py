"""The poss command line: generate, chat, train, distill, eval, serve, import, export, plus info and demo.

Every bad input ends in one line "poss <command>: <what was wrong>" and exit status 2; --debug shows
the traceback instead.
"""

import json
import sys

from poss.cli_args import Formatter, Parser, UsageError, one_line, target_help


def build_parser() -> Parser:
    """The full parser; building it imports no torch, so ``poss --help`` is fast."""
    from poss.decode import cli as decode_cli
    from poss.eval import cli as eval_cli
    from poss.serve import main as serve_cli
    from poss.train import cli as train_cli

    parser = Parser(prog="poss", description=__doc__, formatter_class=Formatter)
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("info", help="show how the poss_ext kernels were built")
    sub.add_parser("demo", help="verify a small draft tree with the tree_verify kernel")
    decode_cli.add_arguments(sub.add_parser("generate", help="generate text for one or more prompts",
                                            formatter_class=Formatter), chat=False)
    decode_cli.add_arguments(sub.add_parser("chat", help="interactive multi-turn chat", formatter_class=Formatter),
                             chat=True)
    train_cli.add_train_parser(sub)
    train_cli.add_distill_parser(sub)
    eval_cli.add_eval_parser(sub)
    serve_cli.add_serve_parser(sub)
    _add_interop_parsers(sub)
    return parser


def _add_interop_parsers(sub) -> None:
    """``poss import`` and ``poss export`` (poss.models.draft_interop; docs/interop.md)."""
    imp = sub.add_parser("import", formatter_class=Formatter,
                         help="convert a published EAGLE / HASS / PosS / EAGLE-3 draft into poss's format")
    imp.add_argument("folder", metavar="FOLDER", help="the published draft (config.json + weights)")
    imp.add_argument("--target", required=True, help="the target it was made for: " + target_help())
    imp.add_argument("--out", required=True, help="folder to write the poss draft and its model card to")
    imp.add_argument("--positions-per-specialist", type=int, default=None,
                     help="positions each layer drafts (the PosS reference's --position_per_layer), "
                          "where config.json does not say")
    exp = sub.add_parser("export", formatter_class=Formatter, help="write a poss draft in a published layout")
    exp.add_argument("draft", metavar="DRAFT", help="a poss draft folder")
    exp.add_argument("--format", required=True, choices=("eagle", "poss-ref", "eagle3"),
                     help="eagle: EAGLE-1/2 and HASS (SGLang, vLLM, the EAGLE code); poss-ref: the PosS "
                          "reference code; eagle3: EAGLE-3 drafts")
    exp.add_argument("--out", required=True, help="folder to write to")
    exp.add_argument("--target", default=None,
                     help="the draft's target, to write its embedding (embed_tokens.weight; poss-ref needs it) and "
                          "context length: " + target_help())
    exp.add_argument("--file-format", choices=("safetensors", "bin"), default="safetensors",
                     help="model.safetensors or pytorch_model.bin")
    exp.add_argument("--shard-mb", type=float, default=None,
                     help="split the weights into shards of at most this many MB")


def _interop_target(target):
    """``(runner, hf_model)`` of ``target`` in float32 (the dtype drafts record fingerprints in)."""
    import torch

    from poss.models.registry import load_model
    from poss.models.target import TargetRunner

    _, model = load_model(target, dtype=torch.float32)
    return TargetRunner(model, max_batch=1, max_seq=8, huge_pages=False), model


def _run_import(args) -> int:
    from poss.models.draft_interop import import_draft

    if args.positions_per_specialist is not None and args.positions_per_specialist < 1:
        raise UsageError(f"--positions-per-specialist must be >= 1, got {args.positions_per_specialist}")
    runner, _ = _interop_target(args.target)
    out = import_draft(args.folder, runner, args.out, str(args.target), args.positions_per_specialist)
    print(f"wrote {out} (model card: {out / 'README.md'})")
    return 0


def _run_export(args) -> int:
    from poss.models.draft_interop import export_draft

    if args.shard_mb is not None and args.shard_mb <= 0:
        raise UsageError(f"--shard-mb must be > 0, got {args.shard_mb}")
    embed, positions = None, 2048
    if args.target is not None:
        runner, model = _interop_target(args.target)
        embed, positions = runner.embed, int(getattr(model.config, "max_position_embeddings", 2048))
    files = export_draft(args.draft, args.format, args.out, embed=embed, file_format=args.file_format,
                         max_shard_bytes=None if args.shard_mb is None else int(args.shard_mb * 2**20),
                         max_positions=positions)
    print(f"wrote {len(files)} files to {args.out}")
    return 0


def _dispatch(args) -> int:
    if args.command in ("generate", "chat"):
        from poss.decode import cli as decode_cli

        return decode_cli.cmd_generate(args) if args.command == "generate" else decode_cli.cmd_chat(args)
    if args.command in ("train", "distill"):
        from poss.train import cli as train_cli

        return train_cli.run_train(args) if args.command == "train" else train_cli.run_distill(args)
    if args.command == "eval":
        from poss.eval import cli as eval_cli

        return eval_cli.run_eval(args)
    if args.command == "serve":
        from poss.serve import main as serve_cli

        return serve_cli.run_serve(args)
    if args.command == "import":
        return _run_import(args)
    if args.command == "export":
        return _run_export(args)
    if args.command == "info":
        import poss_ext

        print(json.dumps(poss_ext.build_info(), indent=2))
        return 0
    if args.command == "demo":
        from poss.demo import main as demo

        return demo()
    raise UsageError(f"unknown command {args.command!r}")


def _is_load_error(exc: BaseException) -> bool:
    """Errors the library raises for bad inputs (and safetensors' own error for a corrupt file)."""
    return isinstance(exc, (ValueError, OSError)) or type(exc).__name__ == "SafetensorError"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    debug, command = "--debug" in argv, ""
    try:
        args, extra = parser.parse_known_args(argv)
        debug, command = args.debug, args.command
        if extra:
            raise UsageError(f"unrecognized arguments: {' '.join(extra)} (see poss {command} --help)")
        return _dispatch(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(file=sys.stderr)
        return 130
    except Exception as exc:
        if debug or not (isinstance(exc, UsageError) or _is_load_error(exc)):
            raise
        text = one_line(exc)
        if not text.startswith("poss"):  # parser errors already name their command
            text = f"poss {command}: {text}"
        print(text, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
