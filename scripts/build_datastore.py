"""Build a lookup datastore (:mod:`poss.decode.datastore`) from ``poss distill`` folders.

    python scripts/build_datastore.py data/distill-smollm2-135m-bf16 data/distill-smollm2-135m-bf16-a128 \
        --out python/poss/data/datastores/smollm2-135m.npz

Every training answer (``split == "train"``) of every folder's ``records.jsonl`` or
``records.jsonl.xz`` becomes one document, except where the same prompt (``source_index``) has a
longer answer in another folder (a greedy answer cut by a smaller cap is the longer one's prefix).
Held-out answers are left out, so that accuracy measured on them is not helped by the datastore.
All folders must record the same target fingerprint in ``meta.json``; it goes into the file, and
:func:`poss.load` uses the datastore only with that target.
"""

import argparse
import json
import lzma
import sys
from pathlib import Path


def records(folder: Path):
    for name, opener in (("records.jsonl", open), ("records.jsonl.xz", lzma.open)):
        if (folder / name).is_file():
            with opener(folder / name, "rt") as f:
                yield from (json.loads(line) for line in f if line.strip())
            return
    raise SystemExit(f"{folder}: no records.jsonl or records.jsonl.xz")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="poss distill output folders")
    ap.add_argument("--out", type=Path, required=True, help="the .npz to write")
    a = ap.parse_args(argv)
    from poss.decode.datastore import Datastore

    fingerprints, longest = set(), {}
    for folder in a.folders:
        meta = json.loads((folder / "meta.json").read_text())
        fingerprints.add(meta["recipe"]["target_fingerprint"])
        for r in records(folder):
            # A shorter greedy answer to the same prompt is the longer one's prefix: keep the longest.
            if r["split"] == "train" and len(r["answer_ids"]) > len(longest.get(r["source_index"], ())):
                longest[r["source_index"]] = r["answer_ids"]
    if len(fingerprints) != 1:
        raise SystemExit(f"the folders answer different targets (fingerprints {sorted(fingerprints)})")
    docs = [longest[src] for src in sorted(longest)]
    store = Datastore.from_documents(docs, meta={"target_fingerprint": fingerprints.pop(),
                                                 "source": [f.name for f in a.folders],
                                                 "documents": len(docs), "split": "train"})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    store.save(a.out)
    print(f"{a.out}: {len(docs):,} answers, {len(store):,} tokens, {a.out.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
