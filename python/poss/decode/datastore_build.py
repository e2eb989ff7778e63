"""A lookup :class:`~poss.decode.datastore.Datastore` built from ``poss distill`` folders.

Every training answer (``split == "train"``) of every folder's ``records.jsonl`` or
``records.jsonl.xz`` becomes one document, except where the same prompt (``source_index``) has a
longer answer in another folder (a greedy answer cut by a smaller cap is the longer one's prefix).
Held-out answers are left out, so that accuracy measured on them is not helped by the datastore.
All folders must record the same target fingerprint in ``meta.json``; it goes into the file, and
:func:`poss.load` uses the datastore only with that target.
"""

import json
from pathlib import Path
from typing import Iterator, Sequence, Union

from poss.jsonl import read_jsonl

PathLike = Union[str, Path]


def distill_records(folder: PathLike) -> Iterator[dict]:
    """The records of a ``poss distill`` folder (``records.jsonl``, else the shipped ``records.jsonl.xz``)."""
    folder = Path(folder)
    for name in ("records.jsonl", "records.jsonl.xz"):
        if (folder / name).is_file():
            yield from read_jsonl(folder / name)
            return
    raise ValueError(f"{folder}: no records.jsonl or records.jsonl.xz (expected a `poss distill` folder)")


def build_datastore(folders: Sequence[PathLike]):
    """The :class:`~poss.decode.datastore.Datastore` of the folders' training answers, one document per
    prompt (its longest answer), documents in ``source_index`` order. Raises ``ValueError`` when a folder
    has no ``meta.json`` or records, or the folders answer different targets."""
    from poss.decode.datastore import Datastore

    folders = [Path(f) for f in folders]
    fingerprints, longest = set(), {}
    for folder in folders:
        if not (folder / "meta.json").is_file():
            raise ValueError(f"{folder}: no meta.json (expected a `poss distill` folder)")
        meta = json.loads((folder / "meta.json").read_text())
        fingerprints.add(meta["recipe"]["target_fingerprint"])
        for r in distill_records(folder):
            # A shorter greedy answer to the same prompt is the longer one's prefix: keep the longest.
            if r["split"] == "train" and len(r["answer_ids"]) > len(longest.get(r["source_index"], ())):
                longest[r["source_index"]] = r["answer_ids"]
    if len(fingerprints) != 1:
        raise ValueError(f"the folders answer different targets (fingerprints {sorted(fingerprints)})")
    docs = [longest[src] for src in sorted(longest)]
    return Datastore.from_documents(docs, meta={"target_fingerprint": fingerprints.pop(),
                                                "source": [f.name for f in folders],
                                                "documents": len(docs), "split": "train"})
