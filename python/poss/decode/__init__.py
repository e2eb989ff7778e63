"""The decoding loop: prefill, then rounds of draft tree -> verify -> commit, over a batch of requests.

:func:`load` builds a :class:`Generator` (``generate`` / ``stream``); :class:`SamplingParams` and
:class:`TreeParams` are what a call chooses. Names are imported on first use, so importing the
package costs no torch.
"""

_LAZY = {
    "Generator": "poss.decode.generator",
    "Result": "poss.decode.generator",
    "Stats": "poss.decode.generator",
    "load": "poss.decode.loader",
    "SamplingParams": "poss.decode.params",
    "TreeParams": "poss.decode.params",
}
__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'poss.decode' has no attribute {name!r}")
