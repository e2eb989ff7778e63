"""Sampling is exact: the first 3 tokens of speculative sampling follow the target's own distribution.

Tiny random Llama over a 16-token vocabulary, T = 0.7 and top-p 0.9. The exact distribution of
(x1, x2, x3) is enumerated from ``transformers`` logits with an independent top-p; thousands of
samples from our loop (PosS draft with 3 specialists, and the plain AR loop) are compared to it by a
chi-square test.
"""

import pytest
import torch

from helpers.loop import (
    hf_greedy,
    make_generator,
    single_thread,  # noqa: F401  (autouse: one CPU thread)
    tiny_target,
)
from helpers.sampling import PROMPT, TOP_P, T, V, chi2_pvalue, exact_distribution, sample


@pytest.fixture(scope="module")
def model():
    m = tiny_target(vocab=V, seed=3)
    with torch.no_grad():  # sharper than the random init: ~100 continuations carry the mass
        m.lm_head.weight.mul_(6.0)
    return m


@pytest.mark.parametrize("draft,draft_vocab,n,features", [
    (True, 0, 3, "last"), (True, 8, 3, "last"), (False, 0, 3, "last"),
    (True, 0, 1, "eagle3"), (True, 8, 3, "eagle3")],
    ids=["poss-n3", "poss-n3-draft-vocab-8", "autoregressive", "eagle3", "poss-n3-eagle3-draft-vocab-8"])
def test_first_three_tokens_follow_the_target(model, draft, draft_vocab, n, features):
    probs = exact_distribution(model)
    extra = dict(features=features, feature_layers=(1, 0, 2)) if features == "eagle3" else {}
    gen = make_generator(model, draft=draft, n=n, ppl=1, aligned=True, draft_vocab=draft_vocab, **extra)
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
