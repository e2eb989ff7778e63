"""Start a shorter-answer `poss distill` folder from a longer one: every answer cut at ``--cap`` tokens.

    python scripts/cut_distill_answers.py data/distill-smollm2-135m-bf16 runs/distill-a128 --cap 128
    poss distill --prompts 6000 --max-new-tokens 128 --dtype bfloat16 --out runs/distill-a128   # new prompts

Greedy decoding is prefix-stable: the first ``cap`` tokens of an answer made with a longer cap are the
answer a ``cap``-token run gives, so the cut records are what ``poss distill --max-new-tokens cap``
would have written for the same prompts (on the machine that made them; another CPU's bf16 kernel can
round differently). An answer longer than the cap becomes ``truncated``. The meta keeps the source's
recipe with the new cap, and its throughput starts at zero, so it counts only answers generated later.
Features are not copied: ``poss distill --rebuild-features`` computes them.

SOURCE is a distill folder (``records.jsonl``) or a shipped data folder (``records.jsonl.xz``).
"""

import argparse
import json
import lzma
import sys
from pathlib import Path


def read_source(folder: Path) -> list:
    """The records of a distill folder or a shipped data folder, in file order."""
    if (folder / "records.jsonl").is_file():
        text = (folder / "records.jsonl").read_text()
    elif (folder / "records.jsonl.xz").is_file():
        text = lzma.decompress((folder / "records.jsonl.xz").read_bytes()).decode()
    else:
        raise SystemExit(f"{folder}: no records.jsonl or records.jsonl.xz")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def cut(record: dict, cap: int) -> dict:
    """``record`` as a ``cap``-token run would have written it."""
    if len(record["answer_ids"]) <= cap:
        return record
    return {**record, "answer_ids": record["answer_ids"][:cap], "truncated": True}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path, help="distill folder or shipped data folder with the longer answers")
    ap.add_argument("out", type=Path, help="the new distill folder (must not hold records yet)")
    ap.add_argument("--cap", type=int, required=True, help="answer tokens at most")
    a = ap.parse_args(argv)
    meta = json.loads((a.source / "meta.json").read_text())
    if not 0 < a.cap <= meta["recipe"]["max_new_tokens"]:
        raise SystemExit(f"--cap must be in 1..{meta['recipe']['max_new_tokens']} (the source's cap), got {a.cap}")
    if (a.out / "records.jsonl").exists():
        raise SystemExit(f"{a.out} already holds records.jsonl; use a new folder")
    records = [cut(r, a.cap) for r in read_source(a.source)]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    n_train = sum(r["split"] == "train" for r in records)
    meta = {"recipe": {**meta["recipe"], "max_new_tokens": a.cap, "n_train": n_train},
            "throughput": {"answer_tokens": 0, "seconds": 0.0}}
    (a.out / "meta.json").write_text(json.dumps(meta, indent=1))
    n_cut = sum(r["truncated"] for r in records)
    print(f"{a.out}: {len(records)} records, {n_cut} of them truncated at {a.cap} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
