"""Append-only JSONL files that survive a kill: the resumable record of distill, eval and regenerate."""

import json
import lzma
from pathlib import Path
from typing import List


def read_jsonl(path) -> List[dict]:
    """The records of ``path`` (none when it does not exist; a ``.xz`` file is decompressed, as the
    data shipped in ``data/`` is). A line cut short by a kill is skipped: the work it recorded is redone
    on resume."""
    path = Path(path)
    if not path.exists():
        return []
    text = lzma.decompress(path.read_bytes()).decode() if path.suffix == ".xz" else path.read_text()
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def open_for_append(path):
    """``path`` opened for appending (created if missing), after dropping a last line cut short by a
    kill: appended after it, the next record would be glued onto the fragment and lost too. Call it
    before reading what is done, so a dropped line is redone."""
    path = Path(path)
    if path.exists():
        with open(path, "rb+") as f:
            data = f.read()
            end = data.rfind(b"\n") + 1
            if end != len(data):
                f.truncate(end)
    return open(path, "a")
