"""The package reports its build and refuses, with the fix, a torch it was not built against."""

import importlib.machinery
import os
import shutil
import subprocess
import sys
from pathlib import Path

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
    # The folder the library was loaded from: a source checkout's _loader defers to the installed
    # copy (poss_ext.__path__), and its own folder holds no _build_info.json.
    monkeypatch.setattr(torch, "__version__", "0.0.1+other")
    with pytest.raises(ImportError, match=r"built against torch .* but torch 0.0.1\+other .*--no-build-isolation"):
        _loader.load_library(poss_ext.__path__[0])


def test_a_source_folder_without_the_library_defers_to_the_installed_copy(tmp_path, monkeypatch):
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    source, site = tmp_path / "checkout" / "poss_ext", tmp_path / "site" / "poss_ext"
    source.mkdir(parents=True)
    site.mkdir(parents=True)
    (site / f"_C{suffix}").touch()
    monkeypatch.setattr(sys, "path", [str(source.parent), str(site.parent)])
    assert _loader.package_dir(str(source)) == str(site)
    assert _loader.package_dir(str(site)) == str(site)
    (site / f"_C{suffix}").unlink()
    assert _loader.package_dir(str(source)) == str(source)  # nothing else: the error says how to build


def test_import_from_a_checkout_without_the_library(tmp_path):
    """``python -c "import poss_ext"`` in a source checkout (no _C) after ``pip install .``."""
    built = Path(poss_ext.__path__[0])
    checkout = tmp_path / "poss_ext"
    checkout.mkdir()
    for f in Path(poss_ext.__file__).parent.glob("*.py"):
        shutil.copy(f, checkout / f.name)
    code = ("import poss_ext, torch; poss_ext.build_info(); print(poss_ext.ops.__file__); "
            "print(torch.ops.poss.tree_verify)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(built.parent)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == str(built / "ops.py")
