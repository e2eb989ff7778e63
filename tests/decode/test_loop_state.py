"""State the loop carries across rounds equals a from-scratch recomputation over the committed text:
every specialist's draft KV cache, and the target features the draft consumes."""

import pytest
import torch

from helpers.loop import (
    eval_prompts,
    make_generator,
    single_thread,  # noqa: F401  (autouse: one CPU thread)
    tiny_target,
)
from poss.decode.engine import DecodeEngine
from poss.decode.params import TreeParams
from poss.models.kv_cache import StaticKVCache
from poss.models.target import chain_parents


def recompute_specialist(draft, j, tokens, feats):
    """Specialist j's K/V over pairs (tokens[t], feats[t]) at positions t, on a fresh cache."""
    saved = draft.caches
    T = tokens.shape[0]
    cfg = draft.config
    draft.caches = StaticKVCache.zeros(cfg.n_specialists, 1, cfg.kv_heads, T + 4, cfg.head_dim, saved.k.dtype,
                                       saved.k.device)
    try:
        draft.step(j, tokens.view(1, T), feats.view(1, T, -1), torch.arange(T).view(1, T),
                   chain_parents([T], T), torch.zeros(1, dtype=torch.int32))
        return draft.caches.k[j, 0, :, :T].clone(), draft.caches.v[j, 0, :, :T].clone()
    finally:
        draft.caches = saved


@pytest.mark.parametrize("n,ppl", [(3, 2), (6, 1), (1, 1)])
def test_draft_caches_match_recomputation_after_several_rounds(n, ppl):
    model = tiny_target(seed=5)
    gen = make_generator(model, draft=True, n=n, ppl=ppl, aligned=True)
    gen.end_ids = set()
    prompts = eval_prompts(1)[:4]
    engine = DecodeEngine(gen, TreeParams(30, 6, 5))
    for p in prompts:
        engine.add(p, 60)
    for _ in range(6):  # the prefill and 6 rounds
        engine.step()
    seq, draft = engine.batch, gen.draft
    assert seq.size == len(prompts)
    assert min(seq.draft_len) > min(len(p) for p in prompts)  # rounds really committed tokens
    for b in range(seq.size):
        d, L = seq.draft_len[b], seq.length[b]
        ids = seq.ids[b, : L + 1]
        with torch.no_grad():  # the target's features over the committed text, from scratch (HF)
            hf_feats = model(ids[:L].view(1, -1), output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(seq.feats[b, :L], hf_feats, rtol=1e-4, atol=1e-4)
        for j in range(n):
            k, v = recompute_specialist(draft, j, ids[1: d + 1], hf_feats[:d])
            torch.testing.assert_close(draft.caches.k[j, b, :, :d], k, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(draft.caches.v[j, b, :, :d], v, rtol=1e-4, atol=1e-4)
