"""poss: Position-Specialist speculative decoding on top of the poss_ext ops.

``poss.load(target, draft)`` gives a :class:`poss.generator.Generator` with ``generate`` and ``stream``.
"""

__version__ = "0.1.0"


def load(*args, **kwargs):
    """See :func:`poss.api.load`."""
    from poss.api import load as _load

    return _load(*args, **kwargs)
