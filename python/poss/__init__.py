"""poss: Position-Specialist speculative decoding on top of the poss_ext ops.

``poss.load(target, draft)`` gives a :class:`poss.decode.Generator` with ``generate`` and ``stream``.
Names are imported on first use, so ``import poss`` (and ``poss --help``) stays light.
"""

__version__ = "0.1.0"

_LAZY = {
    "load": "poss.decode.loader",
    "Generator": "poss.decode.generator",
    "Result": "poss.decode.generator",
    "SamplingParams": "poss.decode.params",
    "TreeParams": "poss.decode.params",
    "shipped_draft": "poss.models.registry",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'poss' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
