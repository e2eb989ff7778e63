"""Loads poss_ext._C and turns the usual failure modes into errors that say how to fix them."""

import json
import os

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


def load_library():
    here = os.path.dirname(__file__)
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
            f"poss_ext._C is not built ({e}). Install poss with `pip install .`, or build in place "
            "with `python setup.py build_ext --inplace`. If poss is installed, Python may be picking up "
            f"the source folder's poss_ext/ ({here}) instead: run from another folder."
        ) from e
    return _C
