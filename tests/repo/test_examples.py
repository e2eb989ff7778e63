"""The README's Python examples (examples/*.py) run as written; the ones that load the real target are slow."""

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.child_env import child_env

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("args", [
    ["tree_verify.py"],
    ["generate.py", "--tiny"],
    pytest.param(["generate.py"], marks=pytest.mark.slow),
    pytest.param(["models.py"], marks=pytest.mark.slow),
], ids=lambda a: " ".join(a))
def test_example_runs(args, tmp_path):
    out = subprocess.run([sys.executable, str(EXAMPLES / args[0]), *args[1:]], cwd=tmp_path, capture_output=True,
                         text=True, env=child_env(OMP_NUM_THREADS="1"), timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
