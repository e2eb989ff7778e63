"""``poss distill``: on-policy draft-training data, made by our own batched generation loop.

The target answers ShareGPT first-turn prompts greedily through the continuous-batching
:class:`~poss.decode.engine.DecodeEngine` (up to ``batch_size`` answers running; a finished row takes
the next prompt at the next step, so a batch's longest answer no longer holds the others back; the
prompts admitted at one step share one prefill, padded to the longest of them) with ``keep_features``
on, so the same run yields

- ``records.jsonl``: one line per prompt, in the order the answers finish: ``{"key", "split", "source_index",
  "prompt_ids", "answer_ids", "truncated"}``. Token ids are those generated (no decode / re-encode
  round trip); ``truncated`` marks answers cut by ``--max-new-tokens`` (no end token is invented);
- ``features/rank0``: the target's features of every position (a :class:`FeatureCache`, fp16),
  keyed the way :class:`poss.train.loop.Trainer` reads them (train: selection position k,
  validation: ``VAL_ID_OFFSET + k``), so training needs no second target pass;
- ``meta.json``: the recipe (target, fingerprint, dtype, seed, lengths) and the throughput.

A training example is ``prompt + answer`` without its last token (whose feature the loop never
computes; the target's distribution at the position before still teaches it), with the loss on the
answer. The held-out split is on-policy too, so its accuracy predicts tau.

The run is resumable: finished answers are written in groups (features flushed before their records),
and a restart skips the keys already in ``records.jsonl``.
"""

import json
import random
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from poss.decode.batch import Request, check_request
from poss.jsonl import open_for_append, read_jsonl
from poss.train.data import Example
from poss.train.features import VAL_ID_OFFSET, FeatureCache


def is_english(text: str, min_chars: int = 16) -> bool:
    """A cheap filter: mostly ASCII letters among the letters, and not trivially short."""
    letters = [c for c in text if c.isalpha()]
    if len(text.strip()) < min_chars or not letters:
        return False
    return sum(c.isascii() for c in letters) / len(letters) >= 0.95


def select_prompts(conversations: List[List[Dict[str, str]]], encode, n_train: int, n_val: int, seed: int,
                   max_prompt_tokens: int, accept: Optional[Callable[[str], bool]] = None
                   ) -> Tuple[List[Tuple[int, List[int]]], List[Tuple[int, List[int]]]]:
    """Shuffled, deduplicated English first-turn prompts that fit ``max_prompt_tokens`` and that
    ``accept`` (when given) keeps.

    Returns ``(val, train)`` lists of ``(source_index, prompt_ids)``; the first ``n_val`` eligible
    prompts of the shuffled order are held out, the next ``n_train`` are for training.
    """
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    seen, picked = set(), []
    for i in order:
        first = next((m["content"] for m in conversations[i] if m["role"] == "user"), "")
        if first in seen or not is_english(first) or (accept is not None and not accept(first)):
            continue
        seen.add(first)
        ids = encode(first)
        if len(ids) > max_prompt_tokens:
            continue
        picked.append((i, ids))
        if len(picked) == n_val + n_train:
            break
    return picked[:n_val], picked[n_val:]


def read_records(out: Path) -> List[dict]:
    """The answered prompts of a data folder (a record cut by a kill is redone on resume)."""
    return read_jsonl(Path(out) / "records.jsonl")


def load_examples(out, split: str, max_len: int = 0) -> List[Example]:
    """The distilled examples of ``split`` in key order; ``max_len > 0`` truncates them."""
    return load_keyed_examples(out, split, max_len)[1]


def record_example(record: dict, max_len: int = 0, answer_tokens: int = 0) -> Example:
    """A record's prompt + answer as a training example, the answer positions in the loss mask.

    The answer's last token is a target only (generation never ran it through the target, so it has
    no features): it is the example's ``next_token``, as the first cut token is after a truncation.
    ``answer_tokens > 0`` keeps the first that many answer positions (the example of a record whose
    answer was cut there); ``max_len > 0`` truncates the example.
    """
    answer = record["answer_ids"][:answer_tokens + 1] if answer_tokens > 0 else record["answer_ids"]
    seq = record["prompt_ids"] + answer
    ids = seq[:-1]
    mask = [0] * len(record["prompt_ids"]) + [1] * (len(answer) - 1)
    if max_len:
        ids, mask = ids[:max_len], mask[:max_len]
    return Example(torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.int64), seq[len(ids)])


def load_keyed_examples(out, split: str, max_len: int = 0) -> Tuple[List[int], List[Example]]:
    """``(keys, examples)`` of ``split`` in key order: the keys name each example's cached features."""
    recs = sorted((r for r in read_records(Path(out)) if r["split"] == split), key=lambda r: r["key"])
    return [r["key"] for r in recs], [record_example(r, max_len) for r in recs]


PROMPT_SOURCES = {"sharegpt": "sharegpt first user turn, English",
                  "sharegpt-code": "sharegpt first user turn, English, coding requests, eval problems excluded"}


def distill(gen, conversations, out, n_train: int, n_val: int = 100, batch_size: int = 32,
            max_new_tokens: int = 384, max_prompt_tokens: int = 384, seed: int = 0, progress: bool = True,
            prompt_source: str = "sharegpt") -> dict:
    """Generate (or continue) the on-policy data set in ``out`` with ``gen`` (a :class:`poss.decode.Generator`,
    greedy); returns the meta record. ``prompt_source``: a key of :data:`PROMPT_SOURCES` (``"sharegpt-code"``
    keeps coding requests only, none sharing text with HumanEval or GSM8K)."""
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if prompt_source not in PROMPT_SOURCES:
        raise ValueError(f"prompt_source {prompt_source!r}: expected one of {', '.join(PROMPT_SOURCES)}")
    accept = None
    if prompt_source == "sharegpt-code":
        from poss.train.code_prompts import code_prompt_filter

        accept = code_prompt_filter()
    val, train = select_prompts(conversations, gen.encode, n_train, n_val, seed, max_prompt_tokens, accept)
    jobs = [(VAL_ID_OFFSET + k, "val", i, p) for k, (i, p) in enumerate(val)]
    jobs += [(k, "train", i, p) for k, (i, p) in enumerate(train)]
    open_for_append(out / "records.jsonl").close()  # drops a line cut by a kill before it is read
    done = {r["key"] for r in read_records(out)}
    todo = [j for j in jobs if j[0] not in done]
    cache = FeatureCache(out / "features" / "rank0", shard_mb=1 << 14)  # flushed once per batch
    meta_path = out / "meta.json"
    meta = read_meta(out)
    recipe = {"target_fingerprint": gen.runner.fingerprint(), "dtype": str(gen.runner.dtype).replace("torch.", ""),
              "seed": seed, "max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens,
              "n_train": len(train), "n_val": len(val), "prompt_source": PROMPT_SOURCES[prompt_source],
              "decoding": "greedy"}
    kept_recipe = meta.get("recipe", recipe)
    # The selection is a prefix of one seeded order, so asking for more training prompts extends the
    # data set; any other difference would mix two recipes in one folder.
    if {**kept_recipe, "n_train": 0} != {**recipe, "n_train": 0}:
        raise ValueError(f"{out} holds a data set made with another recipe ({meta['recipe']}); use a new --out")
    if len(train) < kept_recipe["n_train"]:
        raise ValueError(f"--prompts {len(train)} is fewer than the {kept_recipe['n_train']} training prompts "
                         f"{out} was made for; pass at least that many to resume it")
    gen.keep_features = True
    stats = meta.get("throughput", {"answer_tokens": 0, "seconds": 0.0})
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc="distill", unit="prompt", disable=not progress,
               dynamic_ncols=True)
    flush_every = max(1, batch_size // 4)  # a kill loses at most this many answers (and the running ones)
    finished: List[tuple] = []

    def write(f) -> None:
        for (key, *_), request in finished:
            cache.put(key, request.features)
            stats["answer_tokens"] += len(request.generated)
        cache.flush()  # features reach disk before the records that point at them
        for (key, split, src, prompt), request in sorted(finished, key=lambda jr: jr[0][0]):
            f.write(json.dumps({"key": key, "split": split, "source_index": src, "prompt_ids": prompt,
                                "answer_ids": request.generated,
                                "truncated": request.finish_reason == "length"}) + "\n")
        f.flush()
        stats["tokens_per_s"] = stats["answer_tokens"] / max(stats["seconds"], 1e-9)
        meta_path.write_text(json.dumps({"recipe": recipe, "throughput": stats, "features_dtype": recipe["dtype"]},
                                        indent=1))
        bar.update(len(finished))
        bar.set_postfix_str(f"{stats['tokens_per_s']:.0f} answer tok/s, {stats['answer_tokens']} tokens")
        finished.clear()

    with open(out / "records.jsonl", "a") as f:
        t0 = time.perf_counter()
        for i, request in answers(gen, [p for *_, p in todo], max_new_tokens, batch_size):
            finished.append((todo[i], request))
            if len(finished) >= flush_every:
                stats["seconds"] += time.perf_counter() - t0
                write(f)
                t0 = time.perf_counter()
        stats["seconds"] += time.perf_counter() - t0
        if finished:
            write(f)
    bar.close()
    return read_meta(out) or {"recipe": recipe, "throughput": stats, "features_dtype": recipe["dtype"]}


def answers(gen, prompts: Sequence[List[int]], max_new_tokens: int, batch_size: int) -> Iterator[Tuple[int, Request]]:
    """``gen``'s greedy answers to ``prompts`` as they finish: ``(i, request)`` with ``prompts[i]``'s
    finished :class:`~poss.decode.batch.Request` (``generated`` ids, ``finish_reason``, and its
    ``features`` ``[P + n - 1, H]`` when ``gen.keep_features``).

    Continuous batching: up to ``batch_size`` requests run, admitted in order; a request that ends
    leaves its row at the next step and the next prompt takes it. Every greedy row is what it is alone
    (the engine's batch invariance), so the answers do not depend on ``batch_size`` or on which
    prompts run beside them."""
    from poss.decode.engine import DecodeEngine
    from poss.decode.params import TreeParams

    engine = DecodeEngine(gen, TreeParams(), max_batch=batch_size)
    running: Dict[int, Request] = {}
    vocab = gen.runner.embed.shape[0]
    nxt = 0
    while nxt < len(prompts) or engine.has_work():
        while nxt < len(prompts) and engine.active + engine.pending < batch_size:
            prompt = list(prompts[nxt])
            check_request(prompt, max_new_tokens, vocab, gen.context_limit, f"prompt {nxt}")
            running[nxt] = Request(nxt, prompt, max_new_tokens)
            engine.submit(running[nxt])
            nxt += 1
        for event in engine.step():
            if event.finished:
                yield event.id, running.pop(event.id)


def read_meta(out) -> dict:
    """Data set ``out``'s ``meta.json`` ({} when it has none)."""
    meta_path = Path(out) / "meta.json"
    return json.loads(meta_path.read_text()) if meta_path.exists() else {}


def features_dtype(out) -> Optional[str]:
    """The dtype the target ran in for the features of data set ``out`` ("float32", "bfloat16"):
    ``meta.json``'s ``features_dtype``, else the dtype its answers were generated in (a set made by
    :func:`distill` keeps the features of that same run), else None (no meta.json)."""
    meta = read_meta(out)
    return meta.get("features_dtype", meta.get("recipe", {}).get("dtype"))


def rebuild_features(runner, out, batch_tokens: int = 4096, progress: bool = True, flush_seconds: float = 120.0) -> int:
    """Compute the features of every record in ``out/records.jsonl`` that has none in the cache
    (a data set restored from its shipped token ids): one target prefill per batch of records, no
    generation. Returns how many records were filled in.

    The runner's dtype is recorded in ``meta.json`` as ``features_dtype``. Features of two dtypes
    are never mixed in one cache: filling in a partly built cache in another dtype is a ValueError.
    Features reach disk at least every ``flush_seconds``, so a killed rebuild loses at most that much
    work and a rerun computes only the records still missing."""
    from tqdm import tqdm

    from poss.train.features import FeatureCache

    out = Path(out)
    cache = FeatureCache(out / "features" / "rank0", shard_mb=256)
    records = read_records(out)
    dtype = str(runner.dtype).replace("torch.", "")
    meta = read_meta(out)
    built = meta.get("features_dtype")  # unknown for a cache built before it was recorded
    if built not in (None, dtype) and any(r["key"] in cache for r in records):
        raise ValueError(f"{out} already holds features computed in {built}; rebuild the rest with --dtype {built} "
                         f"(the target runs in {dtype} here), or delete {out / 'features'} to rebuild all in {dtype}")
    meta["features_dtype"] = dtype
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    todo = [r for r in records if r["key"] not in cache]
    todo.sort(key=lambda r: len(r["prompt_ids"]) + len(r["answer_ids"]))  # similar lengths share a batch
    bar = tqdm(total=len(todo), desc="features", unit="record", disable=not progress, dynamic_ncols=True)
    i, flushed = 0, time.monotonic()
    while i < len(todo):
        seqs, n = [], 0
        while i < len(todo) and (not seqs
                                 or n + len(todo[i]["prompt_ids"]) + len(todo[i]["answer_ids"]) <= batch_tokens):
            r = todo[i]
            seqs.append((r["key"], (r["prompt_ids"] + r["answer_ids"])[:-1]))
            n += len(seqs[-1][1])
            i += 1
        runner.cache = runner.cache.grown(len(seqs), max(len(s) for _, s in seqs) + 1)
        with torch.inference_mode():
            _, feats = runner.prefill([s for _, s in seqs])
        for b, (key, s) in enumerate(seqs):
            cache.put(key, feats[b, : len(s)])
        if time.monotonic() - flushed >= flush_seconds:
            cache.flush()
            flushed = time.monotonic()
        bar.update(len(seqs))
    cache.flush()
    bar.close()
    return len(todo)
