"""The poss command line: generate, chat, tune, train, distill, eval, serve, plus info and demo.

Every bad input ends in one line "poss <command>: <what was wrong>" and exit status 2; --debug shows
the traceback instead.
"""

import json
import sys

from poss.cli_args import Formatter, Parser, UsageError, one_line


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
    decode_cli.add_tune_arguments(sub.add_parser("tune", help="time draft tree sizes on this machine (about a minute)",
                                                 formatter_class=Formatter))
    train_cli.add_train_parser(sub)
    train_cli.add_distill_parser(sub)
    eval_cli.add_eval_parser(sub)
    serve_cli.add_serve_parser(sub)
    return parser


def _dispatch(args) -> int:
    if args.command in ("generate", "chat", "tune"):
        from poss.decode import cli as decode_cli

        run = {"generate": decode_cli.cmd_generate, "chat": decode_cli.cmd_chat, "tune": decode_cli.cmd_tune}
        return run[args.command](args)
    if args.command in ("train", "distill"):
        from poss.train import cli as train_cli

        return train_cli.run_train(args) if args.command == "train" else train_cli.run_distill(args)
    if args.command == "eval":
        from poss.eval import cli as eval_cli

        return eval_cli.run_eval(args)
    if args.command == "serve":
        from poss.serve import main as serve_cli

        return serve_cli.run_serve(args)
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
