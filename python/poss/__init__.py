"""poss: Position-Specialist speculative decoding on top of the poss_ext ops.

The orchestrator (models, draft, tree, loop, train, eval) lands here; see the README for status.
"""

__version__ = "0.1.0"
