"""``python -m poss.cli``: the ``poss`` command (as ``torchrun ... -m poss.cli train`` needs)."""

import sys

from poss.cli.main import main

sys.exit(main())
