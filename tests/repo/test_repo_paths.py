"""The repository stands alone: no tracked file outside docs/ names a path on the machine it was written on.

Forbidden: absolute paths under per-user or per-machine roots (home folders, the workspace and scratch
mounts, temporary run folders) and the sibling ``shared`` folder of the development setup. System paths
that are a convention rather than one machine's layout stay allowed: ``/usr/local/cuda`` is where the
CUDA toolkit installs by default, and the build scripts only use it when ``CUDA_HOME`` is unset and it
exists there. ``docs/`` may quote paths (it records where results were made).
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A path segment that starts a path (not the tail of a relative one like python/poss/data/...).
MACHINE_PATH = re.compile(
    r"(?<![\w.~/-])/(?:work|home|root|Users|mnt|scratch|tmp|private|var/folders)/"
    r"|(?<![\w])\.\./shared\b"
)


def tracked_files():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def offending_lines(text):
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if MACHINE_PATH.search(line)]


def test_the_pattern():
    bad = ["cd " + "/wo" + "rk/runs", 'PY="/ho' + 'me/me/venv"', "x = Path('/Us" + "ers/a/b')",
           "--out=/t" + "mp/run1", "open('../" + "shared/data/eval/x')", "(/ro" + "ot/.cache)"]
    good = ["python/poss/data/eval", "/usr/local/cuda/bin/nvcc", "runs/eagle2", "~/.cache/poss",
            "docs/tmp/x", "https://example.org/home/page", "$(mktemp -d)"]
    assert all(offending_lines(s) for s in bad), [s for s in bad if not offending_lines(s)]
    assert not any(offending_lines(s) for s in good), [s for s in good if offending_lines(s)]


def test_no_tracked_file_outside_docs_names_a_machine_path():
    found = []
    for rel in tracked_files():
        if rel.startswith("docs/"):
            continue
        path = ROOT / rel
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (weights, images)
        found += [f"{rel}:{n}: {line}" for n, line in offending_lines(data.decode("utf-8", "replace"))]
    assert not found, "machine-specific paths (use a relative path or a flag):\n" + "\n".join(found)
