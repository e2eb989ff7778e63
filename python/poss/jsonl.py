"""Append-only JSONL files that survive a kill: the resumable record of distill, eval and regenerate."""

import json
from pathlib import Path
from typing import List


def read_jsonl(path) -> List[dict]:
    """The records of ``path`` (none when it does not exist). A line cut short by a kill is skipped:
    the work it recorded is redone on resume."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
