import pytest
import torch

import poss_ext  # noqa: F401  (loads the ops)

HAS_CUDA_KERNELS = torch.cuda.is_available() and poss_ext.build_info()["cuda"]


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a visible CUDA GPU and poss_ext built with CUDA kernels")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA_KERNELS:
            item.add_marker(skip)


def devices():
    """The devices a kernel test runs on: the CPU, plus CUDA (marked, skipped without a GPU)."""
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
