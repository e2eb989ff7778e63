"""``poss eval``: the PosS paper's comparison (tau, pos-acc, speedup) on the benchmark sets.

- :mod:`poss.eval.metrics`: the metrics, defined once (tau, pos-acc, speedup).
- :mod:`poss.eval.run`: answers every question with each method, timed per turn, resumable.
- :mod:`poss.eval.report`: ``results.json``, ``table.md`` and the two plots.
- :mod:`poss.eval.merge`: several runs' folders (shards, groups of sets) as one report.

The ``poss eval`` command is :mod:`poss.cli.eval`.
"""
