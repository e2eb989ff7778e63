"""poss.build_tree against an EAGLE-2-style selection, the reference, SGLang's golden vector and
the tree encoding's invariants."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import poss_ext
from helpers.devices import devices
from poss_ext import reference

# ---------------------------------------------------------------------------------------------
# Candidate beams generated the way the EAGLE-2 draft (topK_genrate) generates them.


def draft_logp(gen, rows, vocab, ties):
    """Log-probs of a stand-in draft head: [rows, vocab] float32.

    With ``ties`` the logits are small integers (many equal log-probs between siblings and
    across the beam) and some rows are one-hot enough that the top child has log-prob exactly 0,
    i.e. the same cumulative score as its parent.
    """
    if ties:
        logits = torch.randint(0, 3, (rows, vocab), generator=gen).float()
        peaked = torch.rand(rows, generator=gen) < 0.3
        logits[peaked, 0] = 200.0
    else:
        logits = torch.randn(rows, vocab, generator=gen) * 2
    return torch.log_softmax(logits, dim=-1)


def eagle_beam(gen, K, depth, vocab, ties=False):
    """One request's EAGLE-2 beam: flattened scores, tokens and EAGLE's parents_flat.

    parents_flat holds, per block of K candidates, the flat index + 1 of their parent (0 = root),
    exactly EAGLE's ``parents_list`` bookkeeping.
    """
    topk_p, topk_idx = torch.topk(draft_logp(gen, 1, vocab, ties)[0], K)
    scores = topk_p
    scores_list, parents_list, ss_token = [scores], [torch.zeros(1, dtype=torch.long)], [topk_idx]
    cs_index = torch.arange(K)
    for i in range(depth):
        bias = 1 + K * K * max(0, i - 1) + (K if i > 0 else 0)
        parents_list.append(cs_index + bias)
        tp, ti = torch.topk(draft_logp(gen, K, vocab, ties), K, dim=-1)
        cu = tp + scores[:, None]
        scores, cs_index = torch.topk(cu.flatten(), K)
        ss_token.append(ti)
        scores_list.append(cu)
    return (
        torch.cat([s.flatten() for s in scores_list]),
        torch.cat([t.flatten() for t in ss_token]),
        torch.cat(parents_list),
    )


def eagle_select(scores_flat, tokens_flat, parents_flat, K, root, total):
    """EAGLE-2's steps 4-5 (rerank, tree mask, position ids), written as EAGLE writes them.

    torch.topk leaves the order of ties open; a stable descending sort is a top-k that breaks
    them toward the lower index, which is the rule build_tree promises.
    Returns (tokens, parents, depth) for the root plus ``total`` nodes.
    """
    top_idx = torch.argsort(scores_flat, descending=True, stable=True)[:total]
    top_idx = torch.sort(top_idx).values
    draft_tokens = torch.cat([torch.tensor([root]), tokens_flat[top_idx]])
    draft_parents = parents_flat[top_idx // K]
    mask_index = torch.searchsorted(top_idx, draft_parents - 1)
    mask_index[draft_parents == 0] = -1
    mask_index = mask_index + 1
    # EAGLE silently builds a wrong tree when a kept node's parent was not kept; make sure the
    # comparison never rests on that.
    real = draft_parents > 0
    assert torch.equal(top_idx[mask_index[real] - 1], draft_parents[real] - 1)
    tree_mask = torch.eye(total + 1, dtype=torch.bool)
    tree_mask[:, 0] = True
    for i in range(total):
        tree_mask[i + 1] |= tree_mask[mask_index[i]]
    depth = tree_mask.sum(1) - 1
    parents = torch.cat([torch.tensor([-1]), mask_index])
    return draft_tokens, parents.int(), depth.int()


def beams_batch(seed, B, K, depth, vocab, ties):
    gen = torch.Generator().manual_seed(seed)
    beams = [eagle_beam(gen, K, depth, vocab, ties) for _ in range(B)]
    scores = torch.stack([b[0] for b in beams]).float()
    tokens = torch.stack([b[1] for b in beams])
    parents_flat = torch.stack([b[2] for b in beams])
    cand_parents = (parents_flat[:, torch.arange(scores.shape[1]) // K] - 1).int()
    roots = torch.randint(0, vocab, (B,), generator=gen)
    return scores, tokens, parents_flat, cand_parents, roots


def run_build(device, tokens, scores, parents, roots, num_nodes):
    out = poss_ext.build_tree(
        tokens.to(device), scores.to(device), parents.to(device), roots.to(device), num_nodes
    )
    return [t.cpu() for t in out]


# ---------------------------------------------------------------------------------------------
# Invariants of the output, checked without any selection logic.


def check_encoding(tokens, parents, depth, num_nodes):
    B = parents.shape[0]
    assert tokens.shape == parents.shape == depth.shape == (B, num_nodes)
    assert tokens.dtype == torch.int64 and parents.dtype == torch.int32 and depth.dtype == torch.int32
    for b in range(B):
        par, dep = parents[b].tolist(), depth[b].tolist()
        assert par[0] == -1 and dep[0] == 0
        n = reference.real_nodes(par)
        for i in range(1, n):
            assert 0 <= par[i] < i
            assert dep[i] == dep[par[i]] + 1
        assert par[n:] == [-2] * (num_nodes - n)
        assert dep[n:] == [0] * (num_nodes - n) and tokens[b, n:].eq(0).all()


def path_min_walk(scores, parents, i):
    """Lowest score on candidate i's path, by walking up (the kernels fold it top-down)."""
    m = scores[i]
    while parents[i] >= 0:
        i = parents[i]
        m = min(m, scores[i])
    return m


def check_selection(cand_tokens, cand_scores, cand_parents, tokens, parents, depth, num_nodes):
    """With unique candidate tokens, recover the kept candidates and check the rule directly:
    ancestor-closed, right size, every kept key above every dropped key, parents and depths
    mapped, index order."""
    for b in range(cand_tokens.shape[0]):
        tok, sc, par = cand_tokens[b].tolist(), cand_scores[b].tolist(), cand_parents[b].tolist()
        real = [i for i in range(len(par)) if par[i] != -2]
        by_token = {tok[i]: i for i in real}
        n = reference.real_nodes(parents[b].tolist())
        kept = [by_token[t] for t in tokens[b, 1:n].tolist()]
        assert n - 1 == min(num_nodes - 1, len(real))
        assert kept == sorted(kept)
        kept_set = set(kept)
        key = {i: (path_min_walk(sc, par, i), -i) for i in real}
        dropped = [i for i in real if i not in kept_set]
        if kept and dropped:
            assert min(key[i] for i in kept) > max(key[i] for i in dropped)
        for node, c in enumerate(kept, start=1):
            p = par[c]
            assert (p in kept_set) or p == -1
            assert parents[b, node] == (0 if p == -1 else kept.index(p) + 1)
            d, q = 1, p
            while q >= 0:
                d, q = d + 1, par[q]
            assert depth[b, node] == d


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    "K,depth,num_nodes,ties",
    [(10, 5, 60, False), (10, 5, 60, True), (4, 3, 8, True), (3, 0, 3, False), (5, 2, 1, False)],
)
def test_matches_eagle2(device, K, depth, num_nodes, ties):
    B = 6
    scores, tokens, parents_flat, cand_parents, roots = beams_batch(0, B, K, depth, 40, ties)
    out = run_build(device, tokens, scores, cand_parents, roots, num_nodes)
    check_encoding(*out, num_nodes)
    total = min(num_nodes - 1, scores.shape[1])
    for b in range(B):
        want = eagle_select(scores[b], tokens[b], parents_flat[b], K, int(roots[b]), total)
        for got, exp in zip(out, want):
            assert torch.equal(got[b, : total + 1], exp.to(got.dtype))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    K=st.integers(1, 6),
    depth=st.integers(0, 4),
    extra=st.integers(0, 8),
    num_nodes=st.integers(1, 120),
    ties=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_eagle2_hypothesis(K, depth, extra, num_nodes, ties, seed):
    vocab = K + extra
    B = 3
    scores, tokens, parents_flat, cand_parents, roots = beams_batch(seed, B, K, depth, vocab, ties)
    out = run_build("cpu", tokens, scores, cand_parents, roots, num_nodes)
    check_encoding(*out, num_nodes)
    total = min(num_nodes - 1, scores.shape[1])
    for b in range(B):
        want = eagle_select(scores[b], tokens[b], parents_flat[b], K, int(roots[b]), total)
        for got, exp in zip(out, want):
            assert torch.equal(got[b, : total + 1], exp.to(got.dtype))


def random_candidates(gen, B, M, tie_levels, empty_frac):
    """Arbitrary forests (not EAGLE-shaped), scores that may rise along a path, many ties, -inf,
    empty slots. Tokens are unique so the kept candidates can be read back from the output."""
    parents = torch.full((B, M), -2, dtype=torch.int32)
    for b in range(B):
        real = []
        for i in range(M):
            if torch.rand((), generator=gen) < empty_frac:
                continue
            pick = int(torch.randint(0, len(real) + 1, (), generator=gen))
            parents[b, i] = -1 if pick == len(real) else real[pick]
            real.append(i)
    scores = torch.randint(0, tie_levels, (B, M), generator=gen).float() * -0.5
    scores[torch.rand(B, M, generator=gen) < 0.05] = -math.inf
    tokens = torch.arange(B * M).view(B, M) + 1000
    roots = torch.arange(B) + 7
    return tokens, scores, parents, roots


@pytest.mark.parametrize("device", devices())
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    B=st.integers(1, 4),
    M=st.integers(0, 70),
    num_nodes=st.integers(1, 80),
    tie_levels=st.integers(1, 8),
    empty_frac=st.sampled_from([0.0, 0.3, 0.9]),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_candidates_vs_reference(device, B, M, num_nodes, tie_levels, empty_frac, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens, scores, parents, roots = random_candidates(gen, B, M, tie_levels, empty_frac)
    out = run_build(device, tokens, scores, parents, roots, num_nodes)
    want = reference.build_tree(tokens, scores, parents, roots, num_nodes)
    for got, exp in zip(out, want):
        assert torch.equal(got, exp)
    check_encoding(*out, num_nodes)
    check_selection(tokens, scores, parents, *out, num_nodes)


@pytest.mark.parametrize("device", devices())
def test_ties_keep_the_parent(device):
    # Candidates 0 (root child, -1.0), 1 = child of 0 with log-prob 0 (-1.0), 2 (root child,
    # -1.0) ... with one slot left among three equal scores the lowest index (0) wins; with two
    # slots, 0 and 1 (the child ties with its parent and with 2, but 1 < 2).
    tokens = torch.tensor([[10, 11, 12, 13]])
    scores = torch.tensor([[-1.0, -1.0, -1.0, -2.0]])
    parents = torch.tensor([[-1, 0, -1, 1]], dtype=torch.int32)
    roots = torch.tensor([5])
    tok, par, dep = run_build(device, tokens, scores, parents, roots, 2)
    assert tok.tolist() == [[5, 10]] and par.tolist() == [[-1, 0]] and dep.tolist() == [[0, 1]]
    tok, par, dep = run_build(device, tokens, scores, parents, roots, 3)
    assert tok.tolist() == [[5, 10, 11]] and par.tolist() == [[-1, 0, 1]] and dep.tolist() == [[0, 1, 2]]
    # A child that outscores its parent ranks with its parent's score (path minimum), never
    # ahead of it: parent 0 at -3.0, its child 1 at 0.0 ranks as -3.0 and loses the tie to 0.
    scores = torch.tensor([[-3.0, 0.0, -1.0, -2.0]])
    tok, par, dep = run_build(device, tokens, scores, parents, roots, 3)
    assert tok.tolist() == [[5, 10, 12]]  # kept: 2 (-1.0), then 0 (-3.0); index order
    tok, par, dep = run_build(device, tokens, scores, parents, roots, 4)
    assert tok.tolist() == [[5, 10, 11, 12]] and par.tolist() == [[-1, 0, 1, 0]]


@pytest.mark.parametrize("device", devices())
def test_signed_zero_scores_are_one_score(device):
    # -0.0 and +0.0 tie: the lower index wins, as in the reference, and a child scored +0 never
    # ranks ahead of its parent scored -0 (which would leave the child's parent unkept).
    tokens, roots = torch.tensor([[10, 11]]), torch.tensor([5])
    for parents in ([[-1, -1]], [[-1, 0]]):
        parents = torch.tensor(parents, dtype=torch.int32)
        scores = torch.tensor([[-0.0, 0.0]])
        got = run_build(device, tokens, scores, parents, roots, 2)
        want = reference.build_tree(tokens, scores, parents, roots, 2)
        assert [t.tolist() for t in got] == [t.tolist() for t in want]
        assert got[0].tolist() == [[5, 10]] and got[1].tolist() == [[-1, 0]]


@pytest.mark.parametrize("device", devices())
def test_ragged_requests_are_padded(device):
    # Request 0: 5 candidates; request 1: 2 (the rest empty); request 2: none.
    tokens = torch.arange(15).view(3, 5) + 100
    scores = -torch.arange(15, dtype=torch.float32).view(3, 5)
    parents = torch.tensor(
        [[-1, 0, -1, 1, 2], [-2, -1, -2, 1, -2], [-2, -2, -2, -2, -2]], dtype=torch.int32
    )
    roots = torch.tensor([1, 2, 3])
    tok, par, dep = run_build(device, tokens, scores, parents, roots, 5)
    assert par.tolist() == [[-1, 0, 1, 0, 2], [-1, 0, 1, -2, -2], [-1, -2, -2, -2, -2]]
    assert tok.tolist() == [[1, 100, 101, 102, 103], [2, 106, 108, 0, 0], [3, 0, 0, 0, 0]]
    assert dep.tolist() == [[0, 1, 2, 1, 3], [0, 1, 2, 0, 0], [0, 0, 0, 0, 0]]
    # More nodes than candidates in the whole batch (M < num_nodes - 1).
    tok, par, dep = run_build(device, tokens, scores, parents, roots, 9)
    check_encoding(tok, par, dep, 9)
    assert par[0].tolist() == [-1, 0, 1, 0, 2, 3, -2, -2, -2]


# SGLang's test_build_tree_kernel_efficient (bs=2, topk=4, 4 draft steps, 8 tree nodes). Its
# candidates are probabilities (monotone along paths, like log-probs), parents are flat candidate
# indices with -1 for the root: exactly build_tree's cand_parents after `parent_list[j // topk]`.
# Its expected outputs (LCRS links, positions, draft tokens) were produced by SGLang's kernel.
SGL_SCORES = [
    [[0.71127, 0.28292, 2.2995e-03, 1.7357e-03], [0.97476, 2.2219e-02, 6.5031e-04, 1.3212e-04]],
    [
        [6.9142e-01, 1.2863e-02, 1.6873e-03, 1.1871e-03, 2.4787e-01, 1.8818e-02, 1.4204e-02, 9.2235e-04,
         2.2971e-03, 1.6700e-06, 1.8737e-07, 8.3146e-08, 1.2771e-03, 2.4374e-04, 1.7832e-04, 1.1947e-05],
        [8.4832e-02, 6.6068e-02, 5.8304e-02, 5.7851e-02, 2.3616e-03, 1.1243e-03, 5.4368e-04, 2.7768e-04,
         2.5286e-04, 1.5578e-04, 2.8817e-05, 1.2888e-05, 1.2834e-04, 2.5417e-06, 1.1279e-06, 1.6088e-08],
    ],
    [
        [6.6438e-01, 2.6997e-02, 2.4236e-05, 4.0821e-06, 2.4402e-01, 2.8409e-03, 5.0935e-04, 2.9022e-04,
         1.6178e-02, 2.0567e-03, 4.5892e-04, 3.0034e-05, 1.3023e-02, 5.0497e-04, 3.6371e-04, 8.7750e-05],
        [2.3263e-02, 2.0054e-02, 9.3990e-03, 2.7783e-03, 6.4156e-02, 5.5506e-04, 1.0429e-04, 9.7211e-05,
         4.9950e-02, 5.0630e-03, 9.0068e-04, 3.3656e-04, 7.5817e-03, 8.5731e-04, 6.9972e-04, 6.0793e-04],
    ],
    [
        [6.6420e-01, 1.0525e-04, 6.5864e-05, 1.2253e-06, 1.3019e-01, 1.0461e-01, 5.2083e-03, 1.6777e-03,
         2.0103e-02, 6.7335e-03, 1.2625e-04, 1.0364e-05, 1.5142e-02, 7.0819e-04, 9.6595e-05, 8.7951e-05],
        [5.8608e-02, 1.8840e-03, 7.8535e-04, 4.4400e-04, 1.2185e-02, 2.0684e-03, 1.7418e-03, 1.4327e-03,
         6.2455e-03, 6.1487e-03, 2.6862e-03, 1.8034e-03, 1.8590e-03, 1.6151e-03, 1.2481e-03, 3.6038e-04],
    ],
]
SGL_TOKENS = [
    [[29896, 29906, 29900, 29945], [13, 2, 29871, 28956]],
    [
        [29889, 29974, 29945, 29900, 29974, 29922, 29930, 29958,
         29889, 29974, 29930, 29945, 29974, 29922, 29930, 29958],
        [22550, 4136, 16492, 8439, 29871, 2, 3001, 13, 2, 13, 29906, 29946, 2, 13, 29871, 259],
    ],
    [
        [29946, 29945, 29953, 29906, 29896, 29945, 29900, 29906,
         29896, 29945, 29906, 29953, 29896, 29945, 29906, 29946],
        [29871, 2, 29901, 29889, 29871, 2, 395, 259, 29901, 29871, 2, 29889, 3001, 1234, 7146, 2186],
    ],
    [
        [29946, 29974, 29945, 29930, 29889, 29922, 29974, 29930,
         29974, 29946, 29930, 29922, 29889, 29974, 29945, 29922],
        [29941, 29906, 2, 29946, 29871, 450, 319, 14990, 29946, 29941, 2, 29906, 29871, 2, 3001, 13],
    ],
]
# SGLang's parents_list without its last entry (that one describes the next frontier).
SGL_PARENTS = [[[-1, 0, 1, 2, 3], [-1, 0, 1, 2, 3]], [[4, 8, 9, 10], [4, 5, 6, 7]],
               [[20, 24, 21, 28], [24, 28, 20, 21]]]


def lcrs(parents_row):
    """SGLang's first-child / next-sibling links from our parent array (children in node order)."""
    n = len(parents_row)
    first, sibling = [-1] * n, [-1] * n
    for i in range(n - 1, 0, -1):
        p = parents_row[i]
        sibling[i], first[p] = first[p], i
    return first, sibling


@pytest.mark.parametrize("device", devices())
def test_sglang_golden_vector(device):
    topk = 4
    scores = torch.tensor([sum((lvl[b] for lvl in SGL_SCORES), []) for b in range(2)])
    tokens = torch.tensor([sum((lvl[b] for lvl in SGL_TOKENS), []) for b in range(2)])
    parent_list = torch.tensor([sum((lvl[b] for lvl in SGL_PARENTS), []) for b in range(2)])
    cand_parents = parent_list[:, torch.arange(scores.shape[1]) // topk].int()
    roots = torch.tensor([29974, 13])
    tok, par, dep = run_build(device, tokens, scores, cand_parents, roots, 8)
    seq_lens = torch.tensor([5, 10])
    assert (dep + seq_lens[:, None]).flatten().tolist() == [5, 6, 6, 7, 7, 8, 8, 9, 10, 11, 12, 12, 12, 12, 13, 14]
    assert [lcrs(p)[0] for p in par.tolist()] == [[1, 3, 4, 5, 6, 7, -1, -1], [1, 2, -1, 6, -1, -1, 7, -1]]
    assert [lcrs(p)[1] for p in par.tolist()] == [[-1, 2, -1, -1, -1, -1, -1, -1], [-1, -1, 3, 4, 5, -1, -1, -1]]
    assert tok.flatten().tolist() == [29974, 29896, 29906, 29889, 29974, 29946, 29896, 29946,
                                      13, 13, 22550, 4136, 16492, 8439, 29871, 29941]


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    gen = torch.Generator().manual_seed(3)
    tokens, scores, parents, roots = random_candidates(gen, 3, 40, 5, 0.2)
    args = (tokens.to(device), scores.to(device), parents.to(device), roots.to(device), 12)
    torch.library.opcheck(torch.ops.poss.build_tree.default, args)


def test_large_batch_parallel_matches_reference():
    scores, tokens, parents_flat, cand_parents, roots = beams_batch(5, 64, 10, 5, 100, False)
    out = run_build("cpu", tokens, scores, cand_parents, roots, 60)
    want = reference.build_tree(tokens, scores, cand_parents, roots, 60)
    for got, exp in zip(out, want):
        assert torch.equal(got, exp)


def good_args():
    return dict(
        cand_tokens=torch.tensor([[3, 4, 5]]),
        cand_scores=torch.tensor([[-1.0, -2.0, -3.0]]),
        cand_parents=torch.tensor([[-1, 0, 1]], dtype=torch.int32),
        root_token=torch.tensor([1]),
        num_nodes=3,
    )


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(cand_tokens=torch.tensor([[3, 4, 5]], dtype=torch.int32)), "cand_tokens must be Long"),
        (dict(cand_tokens=torch.tensor([3, 4, 5])), "cand_tokens must be 2-D"),
        (dict(cand_scores=torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)), "cand_scores must be Float"),
        (dict(cand_scores=torch.tensor([[-1.0, -2.0]])), r"cand_scores.size\(1\)"),
        (dict(cand_parents=torch.tensor([[-1, 0, 1]])), "cand_parents must be Int"),
        (dict(cand_parents=torch.tensor([[-1, 0]], dtype=torch.int32)), r"cand_parents.size\(1\)"),
        (dict(root_token=torch.tensor([1, 2])), r"root_token.size\(0\)"),
        (dict(root_token=torch.tensor([[1]])), "root_token must be 1-D"),
        (dict(num_nodes=0), "num_nodes must be >= 1"),
        (dict(cand_parents=torch.tensor([[-1, 0, 2]], dtype=torch.int32)), r"cand_parents\[0, 2\] = 2"),
        (dict(cand_parents=torch.tensor([[0, 0, 1]], dtype=torch.int32)), r"cand_parents\[0, 0\] = 0"),
        (dict(cand_parents=torch.tensor([[-1, -3, 1]], dtype=torch.int32)), r"cand_parents\[0, 1\] = -3"),
        (dict(cand_parents=torch.tensor([[-2, 0, 1]], dtype=torch.int32)),
         r"cand_parents\[0, 1\] = 0 points to an empty"),
        (dict(cand_scores=torch.tensor([[-1.0, math.nan, -3.0]])), r"cand_scores\[0, 1\] is NaN"),
    ],
)
def test_bad_input(change, match):
    args = good_args()
    args.update(change)
    with pytest.raises(RuntimeError, match=match):
        poss_ext.build_tree(**args)


@pytest.mark.cuda
def test_bad_device():
    args = good_args()
    args["cand_scores"] = args["cand_scores"].cuda()
    with pytest.raises(RuntimeError, match="cand_scores must be on the same device"):
        poss_ext.build_tree(**args)
