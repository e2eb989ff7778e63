"""Sampling is exact: the first 3 tokens of speculative sampling follow the target's own distribution.

Tiny random Llama over a 16-token vocabulary, T = 0.7 and top-p 0.9. The exact distribution of
(x1, x2, x3) is enumerated from ``transformers`` logits with an independent top-p; thousands of
samples from our loop (PosS draft with 3 specialists, and the plain AR loop) are compared to it by a
chi-square test.
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from helpers.loop import (
    hf_greedy,
    make_generator,
    single_thread,  # noqa: F401  (autouse: one CPU thread)
    tiny_target,
)

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


@pytest.fixture(scope="module")
def model():
    m = tiny_target(vocab=V, seed=3)
    with torch.no_grad():  # sharper than the random init: ~100 continuations carry the mass
        m.lm_head.weight.mul_(6.0)
    return m


def sample(gen, calls, batch=64, **kw):
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
    n = counts.sum()
    expected = (probs * n).flatten()
    obs = counts.flatten().double()
    big = expected >= 5
    assert probs.flatten()[~big].sum() < 0.2, "too much mass in pooled cells for a meaningful test"
    f_obs = torch.cat([obs[big], obs[~big].sum().view(1)])
    f_exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    return chisquare(f_obs.numpy(), f_exp.numpy()).pvalue


@pytest.mark.parametrize("draft,draft_vocab", [(True, 0), (True, 8), (False, 0)],
                         ids=["poss-n3", "poss-n3-draft-vocab-8", "autoregressive"])
def test_first_three_tokens_follow_the_target(model, draft, draft_vocab):
    probs = exact_distribution(model)
    gen = make_generator(model, draft=draft, n=3, ppl=1, aligned=True, draft_vocab=draft_vocab)
    counts, accepted = sample(gen, calls=40, depth=3, num_nodes=12, beam_width=4)
    # Never a sequence the target cannot produce (top-p cut it).
    assert counts[probs == 0].sum() == 0
    assert chi2_pvalue(counts, probs) > 1e-3
    if draft:  # draft tokens were really accepted (and rejected) along the way
        assert 0 < accepted < 2 * counts.sum()


def test_chi_square_detects_a_wrong_distribution(model):
    """The test has power: samples at T = 1.0 instead of 0.7 fail it."""
    probs = exact_distribution(model)
    gen = make_generator(model, draft=True, n=3, ppl=1, aligned=True)
    gen.end_ids = set()
    counts = torch.zeros(V, V, V)
    for call in range(40):
        seeds = list(range(call * 64, call * 64 + 64))
        for ids in gen.generate([PROMPT] * 64, 3, temperature=1.0, top_p=TOP_P, seed=seeds, depth=3,
                                num_nodes=12, beam_width=4).token_ids:
            counts[tuple(ids)] += 1
    assert chi2_pvalue(counts, probs) < 1e-3


def test_per_request_sampling_parameters(model):
    """Greedy rows in a sampling batch stay identical to greedy decoding."""
    gen = make_generator(model, draft=True, n=3, ppl=2, aligned=True)  # EOS = 2, as in HF's config
    res = gen.generate([PROMPT] * 4, 24, temperature=[0.0, T, 0.0, 1.3], top_k=[0, 5, 0, 0],
                       top_p=[1.0, TOP_P, 1.0, 0.8], seed=1)
    gen_hf = hf_greedy(model, PROMPT, 24)
    assert res.token_ids[0] == gen_hf and res.token_ids[2] == gen_hf
    assert all(len(t) == 24 or t[-1] == 2 for t in res.token_ids)
