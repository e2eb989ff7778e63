"""``poss info``: how the poss_ext kernels were built (compiler, ISA, CUDA), and what ``--dtype auto``
runs here, as JSON."""

import json


def add_parser(sub):
    return sub.add_parser("info", help="show how the poss_ext kernels were built and what --dtype auto picks here")


def dtype_auto() -> dict:
    """``--dtype auto`` on this machine: the float dtype it is without GGUF blocks, and each dtype choice
    cached for a GGUF target (per thread count: what a plain and a speculative load pick, and the ms per
    pass over the weights at 1 row and at a verify's rows; :mod:`poss.decode.dtype_choice`). Nothing is timed."""
    from poss.decode.dtype_choice import cached_choices, float_candidates

    return {"float": float_candidates()[0], "gguf_targets_timed": cached_choices()}


def run(args) -> int:
    import poss_ext

    print(json.dumps({**poss_ext.build_info(), "dtype_auto": dtype_auto()}, indent=2))
    return 0
