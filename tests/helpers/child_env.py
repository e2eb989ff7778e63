"""The environment for a test's child Python process: it must import the same poss / poss_ext as the
test itself (the installed package in CI, an in-place build in development), never a source folder
that shadows it."""

import os
from pathlib import Path

import poss
import poss_ext


def child_env(**extra: str) -> dict:
    roots = dict.fromkeys(str(Path(m.__file__).resolve().parent.parent) for m in (poss_ext, poss))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(roots), **extra)
