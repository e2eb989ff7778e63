"""The package reports its build and refuses, with the fix, a torch it was not built against."""

import pytest
import torch

import poss_ext
from poss_ext import _loader


def test_build_info_reports_the_build():
    info = poss_ext.build_info()
    assert info["torch_version"] == torch.__version__
    assert isinstance(info["cuda"], bool)
    assert bool(info["cuda_arch_list"]) == info["cuda"]


def test_every_op_is_registered():
    for name in ("tree_verify", "build_tree", "tree_attention", "kv_compact"):
        assert hasattr(torch.ops.poss, name), name


def test_torch_mismatch_is_an_import_error_with_the_fix(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "0.0.1+other")
    with pytest.raises(ImportError, match=r"built against torch .* but torch 0.0.1\+other .*--no-build-isolation"):
        _loader.load_library()
