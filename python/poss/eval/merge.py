"""Merge ``poss eval`` folders (e.g. one process per shard or per group of sets) into one report.

Every input folder holds ``records.jsonl`` and the ``results.json`` its run wrote; their settings and
machine must agree, and so must the settings each record carries (a folder's ``results.json`` only
describes its last invocation). A question answered in more than one input is taken from the last one
(as a resumed ``poss eval`` reads its folder). The output folder gets the merged ``records.jsonl``, the
drafts' ``draft-*.json`` and the report (``results.json``, ``table.md``, plots) of
:func:`poss.eval.report.write`.
"""

import json
import shutil
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple, Union

PathLike = Union[str, Path]


def question_positions(dataset: str) -> Optional[Dict[str, int]]:
    """question_id -> position in the packaged set (None for a custom set)."""
    from poss.data.eval_sets import EVAL_SETS, EXTRA_SETS, load_eval_set

    if dataset not in EVAL_SETS + EXTRA_SETS:
        return None
    return {r["question_id"]: i for i, r in enumerate(load_eval_set(dataset))}


def merge(inputs: Sequence[PathLike], out: PathLike, questions: Optional[Tuple[int, int]] = None) -> dict:
    """Merge the ``poss eval --out`` folders ``inputs`` into ``out``; returns the report's results.

    ``questions=(a, b)`` keeps the questions at positions ``a .. b-1`` of each packaged set (0-based, in
    the set's order), for a table over a subset, e.g. the questions one run timed. Raises ``ValueError``
    when the inputs' settings or machines differ, or an input holds a question its packaged set does not.
    """
    from poss.eval.report import write
    from poss.jsonl import read_jsonl

    out = Path(out)
    for d in inputs:
        if not (Path(d) / "results.json").is_file():
            raise ValueError(f"{d} holds no results.json (expected a `poss eval --out` folder)")
    runs = [json.loads((Path(d) / "results.json").read_text()) for d in inputs]
    for key in ("settings", "machine"):
        if any(r[key] != runs[0][key] for r in runs[1:]):
            raise ValueError(f"the inputs' {key} differ: {[r[key] for r in runs]}")
    out.mkdir(parents=True, exist_ok=True)
    # One record per (method, dataset, question): the last one read wins, as when `poss eval` resumes
    # a folder (poss.eval.run.read_done), so a question answered again in a later input replaces it.
    positions, kept, origin = {}, {}, {}
    for d in inputs:
        for r in read_jsonl(Path(d) / "records.jsonl"):
            if questions is not None:
                pos = positions.setdefault(r["dataset"], question_positions(r["dataset"]))
                if pos is not None and r["question_id"] not in pos:
                    raise ValueError(f"{d} has question {r['question_id']!r}, which the packaged {r['dataset']} "
                                     "set does not hold")
                if pos is None:
                    raise ValueError(f"{d} holds questions of {r['dataset']!r}, not a packaged set: --questions "
                                     "picks by position in a packaged set, so it cannot cut this one")
                if not questions[0] <= pos[r["question_id"]] < questions[1]:
                    continue
            key = (r["method"], r["dataset"], r["question_id"])
            kept.pop(key, None)  # the replacement goes to the end, where it was read
            kept[key], origin[key] = r, d
    settings = {}
    for key, r in kept.items():
        if r.get("settings") is not None:  # records written before settings were stored carry none
            settings.setdefault(json.dumps(r["settings"], sort_keys=True), origin[key])
    if len(settings) > 1:
        raise ValueError(f"the records' settings differ (first seen in {', '.join(map(str, settings.values()))}): "
                         f"{list(settings)}")
    for d in inputs:
        for p in Path(d).glob("draft-*.json"):
            shutil.copy(p, out / p.name)
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept.values()))
    s, m = runs[0]["settings"], runs[0]["machine"]
    return write(out, s["depth"], s, m["threads"], m["dtype"])
