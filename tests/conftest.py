import pytest

from helpers.devices import HAS_CUDA_KERNELS


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a visible CUDA GPU and poss_ext built with CUDA kernels")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA_KERNELS:
            item.add_marker(skip)
