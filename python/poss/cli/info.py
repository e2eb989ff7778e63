"""``poss info``: how the poss_ext kernels were built (compiler, ISA, CUDA), as JSON."""

import json


def add_parser(sub):
    return sub.add_parser("info", help="show how the poss_ext kernels were built")


def run(args) -> int:
    import poss_ext

    print(json.dumps(poss_ext.build_info(), indent=2))
    return 0
