"""poss: Position-Specialist speculative decoding on top of the poss_ext ops.

``poss.load(target, draft)`` gives a :class:`poss.generator.Generator` with ``generate`` and ``stream``.
"""

__version__ = "0.1.0"


def load(*args, **kwargs):
    """See :func:`poss.api.load`."""
    from poss.api import load as _load

    return _load(*args, **kwargs)


def shipped_draft(target: str = "smollm2-135m"):
    """See :func:`poss.api.shipped_draft`: the trained draft folder shipped for ``target``, or None."""
    from poss.api import shipped_draft as _shipped

    return _shipped(target)
