"""The chi-square check of speculative sampling (test_loop_sampling and the tests that rerun it on other
loops): a 16-token vocabulary, T = 0.7 and top-p 0.9, the exact distribution of the first 3 tokens after
``PROMPT`` enumerated from ``transformers`` logits with an independent top-p, the loop's samples counted
against it."""

import itertools

import torch
from scipy.stats import chisquare

V, T, TOP_P = 16, 0.7, 0.9
PROMPT = [3, 9, 4, 1, 12, 7, 7, 5]


def processed(logits: torch.Tensor) -> torch.Tensor:
    """softmax(logits / T) restricted to the smallest top set whose mass reaches TOP_P, renormalised."""
    p = torch.softmax(logits.double() / T, -1)
    sorted_p, order = p.sort(descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, mass_before < TOP_P)
    p = torch.where(keep, p, torch.zeros_like(p))
    return p / p.sum(-1, keepdim=True)


def exact_distribution(model) -> torch.Tensor:
    """``[V, V, V]`` probability of each first-3-token continuation."""
    seqs = torch.tensor([PROMPT + list(c) for c in itertools.product(range(V), repeat=2)])
    with torch.no_grad():
        logits = model(seqs).logits.float()
    P = len(PROMPT)
    p1 = processed(logits[0, P - 1])  # [V]
    p2 = processed(logits[::V, P].view(V, V)[:, :])  # row x1: p(x2 | x1)
    p3 = processed(logits[:, P + 1]).view(V, V, V)  # [x1, x2, x3]
    return p1.view(V, 1, 1) * p2.view(V, V, 1) * p3


def sample(gen, calls, batch=64, **kw):
    """``calls`` batches of ``batch`` seeded 3-token samples of ``PROMPT``: counts ``[V, V, V]`` of each
    continuation, and the number of draft tokens accepted over all of them."""
    gen.end_ids = set()
    counts = torch.zeros(V, V, V)
    accepted = 0
    for call in range(calls):
        # One seed per request: requests that share a prompt and a seed sample alike.
        seeds = [call * batch + i for i in range(batch)]
        res = gen.generate([PROMPT] * batch, 3, temperature=T, top_p=TOP_P, seed=seeds, **kw)
        for ids, s in zip(res.token_ids, res.stats):
            counts[tuple(ids)] += 1
            accepted += sum(k * c for k, c in enumerate(s.accept_hist))
    return counts, accepted


def chi2_pvalue(counts, probs):
    """Chi-square p-value of ``counts`` against ``probs`` (both ``[V, V, V]``), cells expecting under 5 pooled."""
    n = counts.sum()
    expected = (probs * n).flatten()
    obs = counts.flatten().double()
    big = expected >= 5
    assert probs.flatten()[~big].sum() < 0.2, "too much mass in pooled cells for a meaningful test"
    f_obs = torch.cat([obs[big], obs[~big].sum().view(1)])
    f_exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    return chisquare(f_obs.numpy(), f_exp.numpy()).pvalue
