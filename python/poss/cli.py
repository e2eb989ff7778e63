"""The ``poss`` command line: generate, chat, train, plus info and demo (eval is not there yet)."""

import argparse
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="poss", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="show how the poss_ext kernels were built")
    sub.add_parser("demo", help="verify a small draft tree with torch.ops.poss.tree_verify")
    from poss import cli_generate
    from poss.train.cli import add_train_parser
    from poss.train.distill import add_distill_parser

    cli_generate.add_arguments(sub.add_parser("generate", help="generate text for one or more prompts"), chat=False)
    cli_generate.add_arguments(sub.add_parser("chat", help="interactive multi-turn chat"), chat=True)
    add_train_parser(sub)
    add_distill_parser(sub)
    from poss.eval.cli import add_eval_parser

    add_eval_parser(sub)
    from poss.serve.main import add_serve_parser

    add_serve_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "generate":
        return cli_generate.cmd_generate(args)
    if args.command == "chat":
        return cli_generate.cmd_chat(args)
    if args.command == "info":
        import poss_ext

        print(json.dumps(poss_ext.build_info(), indent=2))
        return 0
    if args.command == "train":
        from poss.train.cli import run_train

        return run_train(args)
    if args.command == "eval":
        from poss.eval.cli import run_eval

        return run_eval(args)
    if args.command == "distill":
        from poss.train.distill import run_distill

        return run_distill(args)
    if args.command == "serve":
        from poss.serve.main import run_serve

        return run_serve(args)
    if args.command == "demo":
        from poss.demo import main as demo

        return demo()
    print(f"poss {args.command}: not available yet in poss {__import__('poss').__version__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
