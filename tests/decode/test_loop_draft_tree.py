"""``draft_tree`` against a from-scratch EAGLE-2 / PosS drafter written the slow, obvious way.

The reference runs every frontier node's specialist as a plain eager chain (``PosSDraft.step(eager=True)``,
dense-mask SDPA, a fresh cache) over the whole committed context plus that node's own path, so it
shares neither the catch-up trees, the fused op, the tree-attention kernel nor the draft caches
with the loop. Both feed their candidates to ``build_tree``; the trees must be the same.
"""

import pytest
import torch

import poss_ext
from helpers.loop import (
    eval_prompts,
    make_generator,
    single_thread,  # noqa: F401  (autouse: one CPU thread)
    tiny_target,
)
from poss.decode.draft_tree import draft_tree
from poss.decode.engine import DecodeEngine
from poss.decode.params import TreeParams
from poss.models.kv_cache import StaticKVCache
from poss.models.target import chain_parents


def eager_chain(draft, j, tokens, feats):
    """Specialist j over pairs (tokens[t], feats[t]) at positions t from scratch; last output ``[H]``."""
    saved, T, cfg = draft.caches, tokens.shape[0], draft.config
    draft.caches = StaticKVCache.zeros(cfg.n_specialists, 1, cfg.kv_heads, T + 1, cfg.head_dim, saved.k.dtype,
                                       saved.k.device)
    try:
        with torch.no_grad():
            out = draft.step(j, tokens.view(1, T), feats.view(1, T, -1), torch.arange(T).view(1, T),
                             chain_parents([T], T), torch.zeros(1, dtype=torch.int32), eager=True)
    finally:
        draft.caches = saved
    return out[0, -1]


def reference_candidates(draft, ids, feats, L, depth, K, spare=0):
    """EAGLE-2's candidates (tokens, scores, parents) and, past the first level's ``K``, its next
    ``spare`` best tokens."""
    ctx_tok, ctx_feat = ids[1: L + 1], feats[:L]

    def run(j, path):  # path: [(token, feature paired with it)] from level 1 down to the node
        toks = torch.cat([ctx_tok, torch.tensor([t for t, _ in path], dtype=torch.long)])
        fs = torch.cat([ctx_feat] + [f.view(1, -1) for _, f in path])
        out = eager_chain(draft, j, toks, fs)
        return out, torch.log_softmax(draft.logits(out).float(), -1)

    out, logp = run(draft.specialist_for(1), [])
    spare_tok = logp.topk(K + spare).indices[K:].tolist()
    score, tok = logp.topk(K)
    cand_tok, cand_score, cand_parent = tok.tolist(), score.tolist(), [-1] * K
    frontier = [(int(t), float(s), i, [(int(t), out)]) for i, (t, s) in enumerate(zip(tok, score))]
    for p in range(2, depth + 1):
        j = draft.specialist_for(p)
        children = []
        for _, s, idx, path in frontier:
            out, logp = run(j, path)
            cs, ct = logp.topk(K)
            children += [(int(t), s + float(c), idx, path + [(int(t), out)]) for t, c in zip(ct, cs)]
        base = len(cand_tok)
        cand_tok += [c[0] for c in children]
        cand_score += [c[1] for c in children]
        cand_parent += [c[2] for c in children]
        top = torch.tensor([c[1] for c in children]).topk(K).indices.tolist()
        frontier = [(children[i][0], children[i][1], base + i, children[i][3]) for i in top]
    return cand_tok, cand_score, cand_parent, spare_tok


@pytest.mark.parametrize("n,ppl,depth,K,nodes", [(4, 1, 4, 3, 20), (2, 2, 4, 3, 20), (1, 1, 4, 3, 20),
                                                (2, 2, 3, 10, 4), (4, 1, 2, 10, 6)])
def test_draft_tree_matches_a_from_scratch_drafter(n, ppl, depth, K, nodes):
    # the last two: a beam wider than the tree (the loop drafts num_nodes - 1 wide, the reference K)
    gen = make_generator(tiny_target(seed=8), draft=True, n=n, ppl=ppl, aligned=True)
    gen.end_ids = set()
    engine = DecodeEngine(gen, TreeParams(nodes, depth, K))
    engine.add(eval_prompts(1)[2], 40)
    for _ in range(3):  # the prefill and 3 rounds: the next round catches up on several verified pairs
        engine.step()
    seq = engine.batch
    L = seq.length[0]
    ids, feats = seq.ids[0].clone(), seq.feats[0].clone()
    tree = draft_tree(gen.draft, seq, depth, K, nodes, spare=3)
    tok, score, parent, _ = reference_candidates(gen.draft, ids, feats, L, depth, K)
    # the loop drafts the first level max(1, min(K, nodes - 1)) wide; its spare tokens rank after that
    _, _, _, spare = reference_candidates(gen.draft, ids, feats, L, 1, max(1, min(K, nodes - 1)), spare=3)
    assert tree.spare.tolist() == [spare]
    want = poss_ext.ops.build_tree(torch.tensor([tok]), torch.tensor([score]),
                                   torch.tensor([parent], dtype=torch.int32), ids[L].view(1), nodes)
    assert torch.equal(tree.tokens, want[0]) and torch.equal(tree.parents, want[1])
    assert torch.equal(tree.depth, want[2])
