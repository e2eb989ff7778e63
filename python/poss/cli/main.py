"""The poss command line: generate, chat, train, distill, eval, serve, plus tune, import, export, datastore,
release, info and demo.

Every bad input ends in one line "poss <command>: <what was wrong>" and exit status 2; --debug shows
the traceback instead.
"""

import importlib
import sys

from poss.cli.args import Formatter, Parser, UsageError, one_line

# command -> the module under poss.cli holding its add_parser(sub) and run(args), in --help's order.
# Building the parser imports every module here, so none may import torch at its top.
COMMANDS = {
    "generate": "generate",
    "chat": "chat",
    "serve": "serve",
    "train": "train",
    "distill": "distill",
    "eval": "eval",
    "tune": "tune",
    "import": "draft_import",
    "export": "draft_export",
    "datastore": "datastore",
    "release": "release",
    "info": "info",
    "demo": "demo",
}


def command_module(name: str):
    return importlib.import_module(f"poss.cli.{COMMANDS[name]}")


def build_parser() -> Parser:
    """The full parser; building it imports no torch, so ``poss --help`` is fast."""
    parser = Parser(prog="poss", description=__doc__, formatter_class=Formatter)
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        command_module(name).add_parser(sub)
    return parser


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
        return command_module(command).run(args)
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
