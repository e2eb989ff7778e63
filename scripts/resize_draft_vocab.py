"""Give a reduced-vocabulary draft another K without training: the same weights scoring more or fewer
rows of the target's lm_head, to measure what the draft vocabulary costs in acceptance.

The head is the target's, frozen in training, and the specialists are trained to reproduce the
target's features, so the rows a draft did not train with still score those features as the target
would. A larger K keeps every token of the draft's map and adds the next most frequent answer tokens
of the training data; a smaller K keeps the most frequent tokens of the map. End tokens always stay.
(K = the full vocabulary needs no new file: ``--draft-vocab full``.)

    python scripts/resize_draft_vocab.py drafts/poss2 runs/poss2-k16384 --k 16384 --data runs/distill-bf16
    poss eval --drafts drafts/poss2 runs/poss2-k16384 --datasets mt_bench --turns 1 --max-new-tokens 256 --out DIR
"""

import argparse
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Iterable

import torch
from torch import Tensor


def resized_token_map(token_map: Tensor, counts: Counter, k: int, vocab_size: int, always: Iterable[int]) -> Tensor:
    """``[k] int64`` ascending: a superset of ``token_map`` (its ids, then the most frequent others)
    when ``k`` is larger, else its ``k`` most frequent ids; ``always`` (end tokens) kept either way."""
    from poss.train.draft_vocab import select_draft_vocab

    old = token_map.tolist()
    if k >= len(old):
        return select_draft_vocab(counts, k, vocab_size, always=list(always) + old)
    return select_draft_vocab(Counter({t: counts[t] for t in old}), k, vocab_size,
                              always=[t for t in always if t in set(old)])


def resize(src, dst, k: int, counts: Counter, always: Iterable[int]) -> Path:
    """Save the draft in ``src`` with a ``k``-token map in ``dst`` (the weights unchanged)."""
    from poss.models.draft import PosSDraft

    d = PosSDraft.load(src, dtype=torch.float16)
    if d.token_map is None:
        raise ValueError(f"{src} scores the full vocabulary already: nothing to resize")
    if not 1 <= k <= d.config.vocab:
        raise ValueError(f"--k must be in [1, {d.config.vocab}], got {k}")
    token_map = resized_token_map(d.token_map, counts, k, d.config.vocab, always)
    training = dict(d.config.training, vocab_resized_from=d.config.draft_vocab)
    out = PosSDraft(replace(d.config, draft_vocab=k, training=training)).to(torch.float16)
    state = {n: t for n, t in d.state_dict().items() if n != "token_map"}
    out.load_state_dict(dict(state, token_map=token_map), strict=True)
    out.save(dst)
    return Path(dst)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("draft", help="a reduced-vocabulary draft folder")
    p.add_argument("out", help="folder for the resized draft")
    p.add_argument("--k", type=int, required=True, help="the new draft vocabulary size")
    p.add_argument("--data", required=True, help="a poss distill folder: its training answers rank the tokens")
    p.add_argument("--target", default="smollm2-135m", help="the target (its end tokens stay in the map)")
    args = p.parse_args(argv)

    from poss.decode.stopping import end_token_ids
    from poss.jsonl import read_jsonl
    from poss.models.registry import load_model, resolve
    from poss.train.draft_vocab import token_counts

    records = Path(args.data) / "records.jsonl"
    if not records.is_file():
        p.error(f"--data: no records.jsonl in {args.data}")
    counts = token_counts(r["answer_ids"] for r in read_jsonl(records) if r["split"] == "train")
    tokenizer, model = load_model(resolve(args.target))
    always = end_token_ids(tokenizer, getattr(model, "generation_config", None))
    print(resize(args.draft, args.out, args.k, counts, always))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
