"""The reduced draft vocabulary (FR-Spec; EAGLE-3's draft vocab): the K most frequent answer tokens.

A draft with a reduced vocabulary scores only K rows of the target's lm_head when it drafts and
trains; verification still uses the full vocabulary, so the output is unchanged. The token map
(``[K] int64``, ascending full-vocabulary ids) is stored in the draft's safetensors.
"""

from collections import Counter
from typing import Iterable, Sequence

import torch
from torch import Tensor


def token_counts(answers: Iterable[Sequence[int]]) -> Counter:
    """How often each token id occurs over the given answers (token-id lists)."""
    c: Counter = Counter()
    for a in answers:
        c.update(a)
    return c


def select_draft_vocab(counts: Counter, k: int, vocab_size: int, always: Iterable[int] = ()) -> Tensor:
    """The ``k`` most frequent ids (ties: lower id first), plus ``always`` (end tokens), ascending.

    ``always`` ids take seats of the least frequent ones, so the result has exactly
    ``min(k, vocab_size)`` ids.
    """
    if k < 1:
        raise ValueError(f"draft vocabulary size must be >= 1, got {k}")
    k = min(k, vocab_size)
    keep = [int(t) for t in always if 0 <= int(t) < vocab_size]
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    chosen = list(dict.fromkeys(keep))
    seen = set(chosen)
    for tok, _ in ranked:
        if len(chosen) >= k:
            break
        if tok not in seen and 0 <= tok < vocab_size:
            chosen.append(tok)
            seen.add(tok)
    # Too few distinct tokens in the data: fill with the lowest unused ids so K is as asked.
    fill = (t for t in range(vocab_size) if t not in seen)
    while len(chosen) < k:
        chosen.append(next(fill))
    return torch.tensor(sorted(chosen[:k]), dtype=torch.int64)


def inverse_map(token_map: Tensor, vocab_size: int) -> Tensor:
    """``[vocab_size] int64``: the reduced index of each full id, -1 outside the draft vocabulary."""
    inv = torch.full((vocab_size,), -1, dtype=torch.int64, device=token_map.device)
    inv[token_map] = torch.arange(token_map.numel(), device=token_map.device)
    return inv


def answer_vocabulary(examples, k: int, vocab_size: int, always: Iterable[int] = ()) -> Tensor:
    """The draft vocabulary of a training set: the ``k`` most frequent loss-masked (answer) tokens of
    ``examples`` (:class:`poss.train.data.Example`), plus ``always`` (the end tokens)."""
    answers = [e.input_ids[e.loss_mask.bool()].tolist() for e in examples]
    return select_draft_vocab(token_counts(answers), k, vocab_size, always)


def coverage(token_map: Tensor, answers: Iterable[Sequence[int]]) -> float:
    """Fraction of the answers' tokens inside the draft vocabulary: an upper bound on the share of
    target tokens the draft can ever propose."""
    keep = set(token_map.tolist())
    total = hit = 0
    for a in answers:
        total += len(a)
        hit += sum(t in keep for t in a)
    return hit / max(total, 1)
