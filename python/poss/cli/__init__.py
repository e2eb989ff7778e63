"""The ``poss`` command line: one module per command (``add_parser(sub)`` / ``run(args)``), dispatched by
the table in :mod:`poss.cli.main`; the flags several commands share are declared once in
:mod:`poss.cli.args`. The library packages hold no command-line code.

``poss.cli.main`` here names the entry point (the console script ``poss = "poss.cli:main"``); the
module of that name is ``sys.modules["poss.cli.main"]``.
"""

from poss.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
