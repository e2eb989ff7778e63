"""The six evaluation prompt sets of the PosS paper, shipped inside the package.

``load_eval_set("mt_bench")`` reads a packaged set; any other argument that names a file is read as a
custom set of the same form (JSON Lines, one object per question with a ``turns`` list of strings).
The data card is ``poss/data/eval/README.md``.
"""

import json
import os
from pathlib import Path
from typing import List, Union

EVAL_DIR = Path(__file__).resolve().parent / "eval"

# The order of the paper's tables.
EVAL_SETS = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa")
# Shipped sets outside the paper's six: all 164 HumanEval problems (the coder's benchmark).
EXTRA_SETS = ("humaneval164",)


def eval_set_path(name_or_path: Union[str, "os.PathLike[str]"]) -> Path:
    """The file behind a packaged set name, or the given path when it names a file."""
    if str(name_or_path) in EVAL_SETS + EXTRA_SETS:
        return EVAL_DIR / f"{name_or_path}.jsonl"
    path = Path(name_or_path)
    if path.is_file():
        return path
    raise ValueError(
        f"unknown eval set {str(name_or_path)!r}: expected one of {', '.join(EVAL_SETS + EXTRA_SETS)} "
        "or a JSONL file"
    )


def load_eval_set(name_or_path: Union[str, "os.PathLike[str]"]) -> List[dict]:
    """The records of a packaged set (by name) or of a custom JSONL file, in file order.

    Every record has ``turns``, a non-empty list of strings (MT-Bench has two: the second is asked after
    the model's own first answer); the packaged sets also carry ``question_id`` and ``category``.
    """
    path = eval_set_path(name_or_path)
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            turns = rec.get("turns") if isinstance(rec, dict) else None
            if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
                raise ValueError(f"{path}:{lineno}: expected an object with 'turns', a non-empty list of strings")
            records.append(rec)
    if not records:
        raise ValueError(f"{path}: no records")
    return records
