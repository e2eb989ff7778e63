"""Sampling through tree_verify is exactly the target's distribution (chi-square, 200k draws).

A toy target over V = 8 tokens whose logits depend on the last two tokens verifies a fixed tree in
one round. When the round emits fewer than two tokens the second is sampled from the target
directly. The joint law of the first two generated tokens must equal p(x1 | ctx) p(x2 | ctx, x1),
computed exactly here. Deliberately wrong acceptance rules, simulated with the same machinery,
must fail the same test.

The kernels split the vocabulary into chunks (csrc/include/poss/vocab_split.h); the op also runs with
V = 8 split into chunks of 3, 3, 2 and of one token, and two wrong ways to combine the chunks' partial
masses in the draw must fail the same test (split_draw).
"""

import numpy as np
import pytest
import torch
from scipy import stats

import poss_ext

V = 8
DRAWS = 200_000
CONTEXT = (3, 5)
# A fixed draft tree: node 0 is the root (last context token). Duplicate sibling tokens (nodes 1, 3) and
# leaves at depths 1 and 3 exercise the residual and the leaf bonus.
PARENTS = [-1, 0, 0, 0, 1, 1, 1, 4]
P_VALUE_FLOOR = 1e-4  # a correct sampler fails this one time in 10,000


def target_logits(rng_seed: int = 0):
    rng = np.random.default_rng(rng_seed)
    a = rng.normal(0, 1.6, (V, V))
    b = rng.normal(0, 0.8, (V, V))
    return lambda prefix: a[prefix[-1]] + b[prefix[-2]]


def processed(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float = 0.0,
              min_p_rule: str = "right") -> np.ndarray:
    """softmax(logits / T) -> top-k (ties kept) -> top-p (ties kept) -> min-p, normalised, in float64.

    min_p_rule other than "right" simulates a wrong min-p: "before-top-p" applies it ahead of top-p,
    "absolute" keeps p(x) >= min_p instead of p(x) >= min_p * max p.
    """
    z = logits / temperature
    p = np.exp(z - z.max())
    if 0 < top_k < len(p):
        p[logits < np.sort(logits)[::-1][top_k - 1]] = 0.0
    p /= p.sum()

    def apply_min_p(p):
        if min_p > 0.0:
            p[p < min_p * (1.0 if min_p_rule == "absolute" else p.max())] = 0.0
            p /= p.sum()
        return p

    if min_p_rule == "before-top-p":
        p = apply_min_p(p)
    if top_p < 1.0:
        desc = np.sort(p)[::-1]
        cut = desc[min(np.searchsorted(np.cumsum(desc), top_p), len(desc) - 1)]
        p[p < cut] = 0.0
        p /= p.sum()
    if min_p_rule != "before-top-p":
        p = apply_min_p(p)
    return p


def tree_tokens(logit_fn, params):
    """Draft tokens: each node's children take the most likely target tokens at it (plus one duplicate)."""
    tokens = [CONTEXT[-1]]
    paths = {0: list(CONTEXT)}
    for i, par in enumerate(PARENTS[1:], start=1):
        ranked = np.argsort(-processed(logit_fn(paths[par]), *params), kind="stable")
        rank = sum(1 for j in range(1, i) if PARENTS[j] == par)
        token = tokens[1] if i == 3 else int(ranked[rank])  # node 3 duplicates node 1
        tokens.append(token)
        paths[i] = paths[par] + [token]
    return tokens, paths


def expected_joint(logit_fn, params) -> np.ndarray:
    p1 = processed(logit_fn(list(CONTEXT)), *params)
    return np.stack([p1[x] * processed(logit_fn(list(CONTEXT) + [x]), *params) for x in range(V)])


def first_two(logit_fn, params, tokens, accept_nodes, accept_len, next_token, rng) -> np.ndarray:
    """[DRAWS, 2] first two generated tokens, completing one-token rounds by sampling the target."""
    toks = np.asarray(tokens)
    out = np.empty((len(accept_len), 2), np.int64)
    first = np.where(accept_len >= 1, toks[accept_nodes[:, 1].clip(0)], next_token)
    second = np.where(accept_len >= 2, toks[accept_nodes[:, 2].clip(0)], next_token)
    out[:, 0], out[:, 1] = first, second
    need = np.flatnonzero(accept_len == 0)
    for x in range(V):
        rows = need[first[need] == x]
        if len(rows):
            out[rows, 1] = rng.choice(V, size=len(rows), p=processed(logit_fn(list(CONTEXT) + [x]), *params))
    return out


def chi_square_p(samples: np.ndarray, joint: np.ndarray) -> float:
    observed = np.bincount(samples[:, 0] * V + samples[:, 1], minlength=V * V).astype(float)
    expected = joint.reshape(-1) * len(samples)
    if observed[expected == 0].sum() > 0:
        return 0.0  # a pair the target can never produce
    big = expected >= 5  # pool the sparse cells so the chi-square approximation holds
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def split_draw(residual: np.ndarray, u: np.ndarray, chunk: int, combine: str = "right") -> np.ndarray:
    """Inverse-CDF draws [D] from `residual` [D, V] (unnormalised) with uniforms `u` [D], the vocabulary
    split into chunks of `chunk` tokens as the kernels draw (vocab_split.h): the chunks' masses pick the
    chunk (draw_chunk), a scan of that chunk from the mass before it picks the token.

    Wrong combines: "no-offset" scans the picked chunk from 0 instead of from the mass of the chunks
    before it (the chunk's last tokens win too often); "max-total" takes the largest chunk mass as the
    total where the sum belongs (the first chunks win too often).
    """
    D, n = residual.shape
    starts = np.arange(0, n, chunk)
    sums = np.add.reduceat(residual, starts, axis=1)  # [D, C]
    total = sums.max(1) if combine == "max-total" else sums.sum(1)
    target = u * total
    through = np.cumsum(sums, 1)
    picked = np.minimum((through <= target[:, None]).sum(1), len(starts) - 1)
    out = np.empty(D, np.int64)
    for c, lo in enumerate(starts):
        rows = np.flatnonzero(picked == c)
        if not len(rows):
            continue
        hi = min(lo + chunk, n)
        before = np.zeros(len(rows)) if combine == "no-offset" else through[rows, c] - sums[rows, c]
        cdf = before[:, None] + np.cumsum(residual[rows, lo:hi], 1)
        idx = (cdf <= target[rows, None]).sum(1)
        # Past the chunk's end (rounding, or the wrong rule): its last token with mass.
        last = hi - lo - 1 - np.argmax(residual[rows, lo:hi][:, ::-1] > 0, axis=1)
        out[rows] = lo + np.minimum(idx, last)
    return out


def simulate(logit_fn, params, tokens, paths, uniforms, renormalise=True, leaf_processor=True, min_p_rule="right",
             chunk=None, combine="right"):
    """The acceptance walk in numpy, vectorised over draws, with switchable (wrong) rules. With `chunk`,
    the final draw is split_draw's over chunks of that many tokens."""
    n = len(PARENTS)
    children = {i: [c for c in range(1, n) if PARENTS[c] == i] for i in range(n)}
    probs = {i: processed(logit_fn(paths[i]), *params, min_p_rule=min_p_rule) for i in range(n)}
    raw = {i: processed(logit_fn(paths[i]), 1.0, 0, 1.0) for i in range(n)}
    D = len(uniforms)
    cur = np.zeros(D, np.int64)
    nodes = np.full((D, n), -1, np.int64)
    nodes[:, 0] = 0
    length = np.zeros(D, np.int64)
    nxt = np.full(D, -1, np.int64)
    active = np.ones(D, bool)
    while active.any():
        for node in range(n):
            sel = np.flatnonzero(active & (cur == node))
            if not len(sel):
                continue
            leaf = not children[node]
            base = raw[node] if (leaf and not leaf_processor) else probs[node]
            residual = np.repeat(base[None], len(sel), 0)
            accepted = np.full(len(sel), -1)
            for c in children[node]:
                x = tokens[c]
                undecided = accepted < 0
                mass = residual.sum(1) if renormalise else 1.0
                ok = undecided & (residual[:, x] > 0) & (uniforms[sel, c] * mass < residual[:, x])
                accepted[ok] = c
                residual[undecided & ~ok, x] = 0.0
            go = accepted >= 0
            length[sel[go]] += 1
            nodes[sel[go], length[sel[go]]] = accepted[go]
            cur[sel[go]] = accepted[go]
            stop = sel[~go]
            res = residual[~go]
            if chunk is None:
                cdf = np.cumsum(res, 1)
                nxt[stop] = (cdf < (uniforms[stop, n] * cdf[:, -1])[:, None]).sum(1)
            else:
                nxt[stop] = split_draw(res, uniforms[stop, n], chunk, combine)
            active[stop] = False
    return nodes, length, nxt


# top-k, top-p and min-p together, where applying min-p ahead of top-p would change the law.
MIN_P_ORDER_PARAMS = (2.0, 6, 0.8, 0.4)
# (temperature, top_k, top_p, min_p); min_p = 0 calls the op without min_p.
PARAMS = [(1.0, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.3, 4, 1.0, 0.0), (0.7, 5, 0.8, 0.0), (1.0, 0, 1.0, 0.15),
          MIN_P_ORDER_PARAMS]


def param_id(p):
    return f"T{p[0]}-k{p[1]}-p{p[2]}-minp{p[3]}"


@pytest.mark.parametrize("params", PARAMS, ids=param_id)
def test_tree_verify_samples_the_target_exactly(params):
    check_op_samples_the_target(params)


# Chunks of 3 tokens (3, 3, 2: uneven) and of 1 token (8 chunks); the processors that use the split
# thresholds (top-k, top-p, min-p) and the plain draw.
@pytest.mark.parametrize("chunk", [3, 1])
@pytest.mark.parametrize("params", [PARAMS[0], PARAMS[3], MIN_P_ORDER_PARAMS], ids=param_id)
def test_tree_verify_split_across_the_vocabulary_samples_the_target_exactly(chunk, params):
    previous = poss_ext.ops.force_vocab_chunk_len(chunk)
    try:
        check_op_samples_the_target(params)
    finally:
        poss_ext.ops.force_vocab_chunk_len(previous)


def check_op_samples_the_target(params):
    logit_fn = target_logits()
    tokens, paths = tree_tokens(logit_fn, params)
    n = len(PARENTS)
    logits = torch.tensor(np.stack([logit_fn(paths[i]) for i in range(n)]), dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    uniforms = torch.rand(DRAWS, n + 1, generator=gen)
    temperature, top_k, top_p, min_p = params
    nodes, length, nxt = poss_ext.tree_verify(
        torch.tensor([PARENTS], dtype=torch.int32).expand(DRAWS, n),
        torch.tensor([tokens]).expand(DRAWS, n),
        logits.expand(DRAWS, n, V),
        torch.full((DRAWS,), temperature),
        torch.full((DRAWS,), top_k, dtype=torch.int32),
        torch.full((DRAWS,), top_p),
        uniforms,
        min_p=torch.full((DRAWS,), min_p) if min_p > 0 else None,
    )
    assert int(length.max()) >= 2, "the tree never accepted two tokens: the test would be weak"
    samples = first_two(logit_fn, params, tokens, nodes.numpy(), length.numpy(), nxt.numpy(), np.random.default_rng(2))
    p = chi_square_p(samples, expected_joint(logit_fn, params))
    assert p > P_VALUE_FLOOR, f"chi-square p = {p:.3g}: tree_verify does not sample the target"


@pytest.mark.parametrize(
    "rule,params",
    [
        (dict(renormalise=False), (0.7, 5, 0.8, 0.0)),  # accept with p(x), not p(x) / remaining mass
        (dict(leaf_processor=False), (0.7, 5, 0.8, 0.0)),  # the PosS/HASS leaf-bonus bug
        (dict(min_p_rule="absolute"), (1.0, 0, 1.0, 0.15)),  # p(x) >= min_p, not min_p * max p
        (dict(min_p_rule="before-top-p"), MIN_P_ORDER_PARAMS),  # min-p ahead of top-p
        # The split draw (chunks of 3 tokens) with the right combine must pass and wrong ones fail.
        (dict(chunk=3, combine="no-offset"), (1.0, 0, 1.0, 0.0)),
        (dict(chunk=3, combine="max-total"), (1.0, 0, 1.0, 0.0)),
    ],
    ids=["no-renormalise", "leaf-bonus-without-processor", "min-p-absolute", "min-p-before-top-p",
         "split-no-offset", "split-max-total"],
)
def test_wrong_rules_fail_the_same_test(rule, params):
    logit_fn = target_logits()
    tokens, paths = tree_tokens(logit_fn, params)
    uniforms = np.random.default_rng(3).random((DRAWS, len(PARENTS) + 1))
    joint = expected_joint(logit_fn, params)
    rng = np.random.default_rng(4)
    split = {k: v for k, v in rule.items() if k == "chunk"}  # the right rule, split the same way
    right = first_two(logit_fn, params, tokens, *simulate(logit_fn, params, tokens, paths, uniforms, **split), rng)
    assert chi_square_p(right, joint) > P_VALUE_FLOOR, "the simulation of the right rule must pass"
    wrong = first_two(logit_fn, params, tokens, *simulate(logit_fn, params, tokens, paths, uniforms, **rule), rng)
    assert chi_square_p(wrong, joint) < 1e-12
