"""Data shipped with poss: the six evaluation prompt sets (see ``eval/README.md``)."""

from poss.data.eval_sets import EVAL_SETS, load_eval_set

__all__ = ["EVAL_SETS", "load_eval_set"]
