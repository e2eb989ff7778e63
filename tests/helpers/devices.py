"""Which devices a kernel test runs on."""

import pytest
import torch

import poss_ext

HAS_CUDA_KERNELS = torch.cuda.is_available() and poss_ext.build_info()["cuda"]


def devices():
    """The CPU, plus CUDA (marked `cuda`, skipped unless a GPU is visible and CUDA kernels were built)."""
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
