"""The coder target's architecture on a tiny random model: Qwen2 with q/k/v biases, an untied lm_head,
rope_theta 1e6 and Qwen2.5's full 151,936-token vocabulary. Greedy speculation is token-identical to
``transformers`` greedy decoding, and speculative sampling follows the target's own distribution
(chi-square over the first three tokens, the exact distribution enumerated over the top-p support)."""

import pytest
import torch
from scipy.stats import chisquare

from helpers.loop import eval_prompts, hf_greedy, make_generator, single_thread  # noqa: F401
from helpers.targets import tiny_model

V, T, TOP_P = 151_936, 0.7, 0.9
PROMPT = [3, 9, 4, 1, 12, 7, 7, 5]


@pytest.fixture(scope="module")
def coder():
    # head dim 64 (2 heads of a 128-wide model): the smallest the tree-attention kernels take
    m = tiny_model("qwen2", seed=5, vocab_size=V, hidden_size=128, intermediate_size=256, rope_theta=1e6,
                   tie_word_embeddings=False, num_attention_heads=2, num_key_value_heads=1,
                   max_position_embeddings=512)
    assert not m.config.tie_word_embeddings and m.model.layers[0].self_attn.q_proj.bias is not None
    with torch.no_grad():
        m.lm_head.weight.mul_(40.0)  # sharp enough that a handful of tokens carry the top-p mass
        for name, p in m.named_parameters():  # layers that add little: an "aligned" random draft agrees often
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(0.01)
    m.generation_config.eos_token_id = None
    return m


def bigram_generator(model, **draft_kw):
    """A generator whose random draft predicts exactly the target's embedding bigram map: with 151,936
    tokens and a sharp head the loosely aligned draft of ``random_draft`` is never accepted."""
    gen = make_generator(model, draft=True, aligned=True, **draft_kw)
    d, H = gen.draft, gen.draft.config.hidden
    with torch.no_grad():
        for j in range(d.config.n_specialists):
            fc = d.fc_for(j)
            fc.weight.zero_()
            fc.weight[:, :H] = torch.diag(gen.runner.final_norm_w.float()).to(fc.weight.dtype)
            d.layers[j].o_proj.weight.zero_()
            d.layers[j].down_proj.weight.zero_()
    return gen


def test_greedy_speculation_matches_hf(coder):
    prompts = eval_prompts(n_per_set=1, max_len=24, vocab=V)
    want = [hf_greedy(coder, p, 24) for p in prompts]
    for kw in ({"n": 3, "ppl": 2}, {"n": 2, "schedule": [1, 5], "fc_per_specialist": True}):
        gen = bigram_generator(coder, **kw)
        got, stats = [], []
        for p in prompts:
            res = gen.generate([p], 24, depth=3, num_nodes=12, beam_width=4)
            got.append(res.token_ids[0])
            stats.append(res.stats[0])
        assert got == want, kw
        assert max(k for s in stats for k, c in enumerate(s.accept_hist) if c) >= 2  # long paths were accepted


def processed(logits: torch.Tensor) -> torch.Tensor:
    """softmax(logits / T) cut to the smallest top set whose mass reaches TOP_P, renormalised (float64)."""
    p = torch.softmax(logits.double() / T, -1)
    sorted_p, order = p.sort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, (sorted_p.cumsum(-1) - sorted_p) < TOP_P)
    p = torch.where(keep, p, torch.zeros_like(p))
    return p / p.sum(-1, keepdim=True)


def last_logits(model, seqs):
    with torch.no_grad():
        h = model.model(torch.tensor(seqs)).last_hidden_state[:, -1]
        return model.lm_head(h).float()


def exact_distribution(model):
    """{(x1, x2, x3): probability} over every continuation the target can sample."""
    p1 = processed(last_logits(model, [PROMPT])[0])
    s1 = p1.nonzero().flatten().tolist()
    p2 = processed(last_logits(model, [PROMPT + [a] for a in s1]))
    pairs = [(a, b) for i, a in enumerate(s1) for b in p2[i].nonzero().flatten().tolist()]
    p3 = processed(last_logits(model, [PROMPT + [a, b] for a, b in pairs]))
    out = {}
    for k, (a, b) in enumerate(pairs):
        pab = float(p1[a] * p2[s1.index(a), b])
        for c in p3[k].nonzero().flatten().tolist():
            out[(a, b, c)] = pab * float(p3[k, c])
    return out


def chi2_pvalue(counts, probs):
    n = sum(counts.values())
    cells = sorted(probs, key=probs.get, reverse=True)
    big = [c for c in cells if probs[c] * n >= 5]
    small_mass = sum(probs[c] for c in cells if probs[c] * n < 5)
    assert small_mass < 0.2, "too much mass in pooled cells for a meaningful test"
    obs = [counts.get(c, 0) for c in big] + [n - sum(counts.get(c, 0) for c in big)]
    exp = [probs[c] * n for c in big] + [small_mass * n]
    return chisquare(obs, exp).pvalue


def sample(gen, temperature, calls=12, batch=64):
    counts, accepted = {}, 0
    for seed in range(calls):
        res = gen.generate([PROMPT] * batch, 3, temperature=temperature, top_p=TOP_P, depth=3, num_nodes=12,
                           beam_width=4, seed=[seed * batch + i for i in range(batch)])  # one seed per request
        for ids, s in zip(res.token_ids, res.stats):
            counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
            accepted += sum(k * c for k, c in enumerate(s.accept_hist))
    return counts, accepted


@pytest.mark.slow  # a 151,936-token top-p per tree node: about 2 minutes on one core
def test_sampling_follows_the_target_and_the_test_has_power(coder):
    probs = exact_distribution(coder)
    gen = bigram_generator(coder, n=2, schedule=[1, 5], fc_per_specialist=True)
    counts, accepted = sample(gen, T)
    assert all(c in probs for c in counts), "sampled a continuation the target cannot produce"
    assert chi2_pvalue(counts, probs) > 1e-3
    assert 0 < accepted  # draft tokens were really accepted along the way
    wrong, _ = sample(gen, 1.0)  # T = 1.0 instead of 0.7: the same test must reject it
    wrong = {c: n for c, n in wrong.items() if c in probs}
    assert chi2_pvalue(wrong, probs) < 1e-3
