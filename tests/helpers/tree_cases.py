"""Random draft trees and target logits for the tree_verify tests and benchmarks."""

import numpy as np
import torch

PAD = -2


def random_parents(rng: np.random.Generator, n_real: int, n_total: int, shape: str) -> np.ndarray:
    """One request's parents row: `shape` is "random", "chain" or "star"; padding after n_real."""
    parents = np.full(n_total, PAD, np.int32)
    parents[0] = -1
    for i in range(1, n_real):
        if shape == "chain":
            parents[i] = i - 1
        elif shape == "star":
            parents[i] = 0
        else:
            parents[i] = rng.integers(0, i)
    return parents


def make_case(
    rng: np.random.Generator,
    B: int,
    N: int,
    V: int,
    shape: str = "random",
    ragged: bool = True,
    match_prob: float = 0.6,
    dup_prob: float = 0.2,
    peak: float = 4.0,
):
    """A batch of trees whose drafts often agree with the target, so walks go deep.

    Each child's token is, with probability `match_prob`, the target's argmax at its parent (with a
    peaked logit so sampling accepts it often too); with `dup_prob` a copy of an earlier sibling's
    token; otherwise uniform. Returns (parents [B,N] int32, tokens [B,N] int64, logits [B,N,V] fp32).
    """
    logits = rng.standard_normal((B, N, V)).astype(np.float32)
    parents = np.empty((B, N), np.int32)
    tokens = np.zeros((B, N), np.int64)
    for b in range(B):
        n_real = int(rng.integers(1, N + 1)) if ragged and b > 0 else N
        parents[b] = random_parents(rng, n_real, N, shape)
        tokens[b, 0] = rng.integers(0, V)
        for i in range(1, n_real):
            p = parents[b, i]
            siblings = [j for j in range(1, i) if parents[b, j] == p]
            r = rng.random()
            if r < match_prob:
                tokens[b, i] = int(np.argmax(logits[b, p]))
                logits[b, p, tokens[b, i]] += peak
            elif r < match_prob + dup_prob and siblings:
                tokens[b, i] = tokens[b, siblings[int(rng.integers(0, len(siblings)))]]
            else:
                tokens[b, i] = rng.integers(0, V)
    return torch.from_numpy(parents), torch.from_numpy(tokens), torch.from_numpy(logits)


def sampling_params(rng: np.random.Generator, B: int, V: int, greedy_frac: float = 0.25):
    """Per-request temperature / top-k / top-p, a mix of greedy and sampling requests."""
    temperature = rng.choice([0.5, 0.7, 1.0, 1.5], size=B).astype(np.float32)
    temperature[rng.random(B) < greedy_frac] = 0.0
    top_k = rng.choice([0, 0, 1, 3, 20, V + 5], size=B).astype(np.int32)
    top_p = rng.choice([1.0, 1.0, 0.95, 0.8, 0.5], size=B).astype(np.float32)
    return torch.from_numpy(temperature), torch.from_numpy(top_k), torch.from_numpy(top_p)


def min_p_values(rng: np.random.Generator, B: int):
    """Per-request min-p ``[B] float32``: off for some requests, mild to aggressive for the others."""
    return torch.from_numpy(rng.choice([0.0, 0.02, 0.1, 0.3, 0.9, 1.0], size=B).astype(np.float32))
