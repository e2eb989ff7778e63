"""Loads poss_ext._C and turns the usual failure modes into errors that say how to fix them.

Run from a source checkout after ``pip install .``, Python finds the checkout's ``poss_ext/`` first
(the current folder is on ``sys.path``), and that folder has no compiled ``_C``. :func:`package_dir`
then points the package at the installed copy, so the checkout's folder does not shadow it.
"""

import importlib.machinery
import json
import os
import sys
from typing import Optional

import torch

_REBUILD = (
    "Rebuild poss against the torch you run: `pip install --no-build-isolation .` "
    "from the poss source folder (add `--force-reinstall --no-deps` if it is already installed)."
)


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _has_library(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, "_C" + suffix))
               for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def installed_copy(source_dir: str) -> Optional[str]:
    """Another ``poss_ext`` folder on ``sys.path`` with a built ``_C`` (an installed poss), or None."""
    here = os.path.realpath(source_dir)
    for entry in sys.path:
        folder = os.path.join(entry or os.getcwd(), "poss_ext")
        if os.path.realpath(folder) != here and _has_library(folder):
            return folder
    return None


def package_dir(source_dir: str) -> str:
    """The folder poss_ext's modules load from: ``source_dir`` when it holds ``_C`` (an installed
    package, an editable install, an in-place build), else an installed copy when there is one."""
    if _has_library(source_dir):
        return source_dir
    return installed_copy(source_dir) or source_dir


def load_library(here: Optional[str] = None):
    """Imports ``poss_ext._C`` (from ``here``, poss_ext's folder), checking the torch it was built against."""
    here = here or os.path.dirname(__file__)
    info_path = os.path.join(here, "_build_info.json")
    if os.path.exists(info_path):
        with open(info_path) as f:
            built = json.load(f)["torch_version"]
        if built != torch.__version__:
            raise ImportError(
                f"poss_ext was built against torch {built}, but torch {torch.__version__} is "
                f"installed. {_REBUILD}"
            )
    flags = _cpu_flags()
    if flags and not {"avx2", "fma"} <= flags:
        raise ImportError("poss_ext's CPU kernels need a CPU with AVX2 and FMA; this CPU lacks them.")
    try:
        from poss_ext import _C
    except ImportError as e:
        if "undefined symbol" in str(e):
            raise ImportError(f"poss_ext._C does not match the installed torch ({e}). {_REBUILD}") from e
        raise ImportError(
            f"poss_ext._C is not built ({e}) in {here}, and no installed poss_ext was found on sys.path. "
            "Install poss with `pip install .` (or `pip install -e .` to work on the source), or build in "
            "place with `python setup.py build_ext --inplace`."
        ) from e
    return _C
