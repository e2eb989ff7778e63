"""The ``poss`` command line: generate, chat, train, distill, eval, serve, plus info and demo.

Parsers are built without importing torch; each command imports what it runs.
"""

import argparse
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="poss", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="show how the poss_ext kernels were built")
    sub.add_parser("demo", help="verify a small draft tree with torch.ops.poss.tree_verify")
    from poss.decode import cli as decode_cli
    from poss.eval import cli as eval_cli
    from poss.serve import main as serve_cli
    from poss.train import cli as train_cli

    fmt = argparse.ArgumentDefaultsHelpFormatter
    decode_cli.add_arguments(sub.add_parser("generate", help="generate text for one or more prompts",
                                            formatter_class=fmt), chat=False)
    decode_cli.add_arguments(sub.add_parser("chat", help="interactive multi-turn chat", formatter_class=fmt), chat=True)
    train_cli.add_train_parser(sub)
    train_cli.add_distill_parser(sub)
    eval_cli.add_eval_parser(sub)
    serve_cli.add_serve_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "generate":
        return decode_cli.cmd_generate(args)
    if args.command == "chat":
        return decode_cli.cmd_chat(args)
    if args.command == "info":
        import poss_ext

        print(json.dumps(poss_ext.build_info(), indent=2))
        return 0
    if args.command == "train":
        return train_cli.run_train(args)
    if args.command == "eval":
        return eval_cli.run_eval(args)
    if args.command == "distill":
        return train_cli.run_distill(args)
    if args.command == "serve":
        return serve_cli.run_serve(args)
    if args.command == "demo":
        from poss.demo import main as demo

        return demo()
    print(f"poss {args.command}: not available yet in poss {__import__('poss').__version__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
