"""Prompt lookup in the tree (poss.decode.lookup): the n-gram search against a plain reference, the
trie merge's tree encoding, and the loop with lookup: greedy token-identical to HF, sampling exact."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import poss_ext
from helpers.loop import eval_prompts, hf_greedy, make_generator, single_thread, tiny_target  # noqa: F401
from helpers.sampling import V, chi2_pvalue, exact_distribution, sample
from poss.decode.draft_tree import Tree
from poss.decode.lookup import add_lookup, continuation
from poss.decode.params import TreeParams


def continuation_reference(ctx, k, max_ngram=3):
    """The definition, by brute force over lists."""
    L = len(ctx)
    for n in range(min(max_ngram, L - 1), 0, -1):
        for s in range(L - n - 1, -1, -1):
            if ctx[s: s + n] == ctx[L - n:]:
                return ctx[s + n: s + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5) | st.integers(0, 2**32 - 1), max_size=40), st.integers(0, 6))
def test_continuation_matches_the_brute_force_definition(ctx, k):
    want = continuation_reference(ctx, k) if k > 0 else []
    assert continuation(ctx, k) == want


def test_continuation_prefers_the_longest_ngram_then_the_latest():
    # last 3 tokens (1, 2, 3) occur once, at the start: their continuation beats later 1-gram matches of 3
    assert continuation([1, 2, 3, 9, 5, 3, 7, 1, 2, 3], 2) == [9, 5]
    assert continuation([4, 3, 8, 3, 6, 3], 1) == [6]  # the latest earlier 3
    assert continuation([1, 2, 3], 4) == []


def random_tree(B, N, seed):
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((B, N), -1, dtype=torch.int32)
    depth = torch.zeros(B, N, dtype=torch.int32)
    for i in range(1, N):
        parents[:, i] = torch.randint(0, i, (B,), generator=g)
        depth[:, i] = depth.gather(1, parents[:, i:i + 1].long()).squeeze(1) + 1
    tokens = torch.randint(0, 6, (B, N), generator=g)
    return Tree(tokens, parents, depth)


def path_tokens(tree, b, node):
    out = []
    while node > 0:
        out.append(int(tree.tokens[b, node]))
        node = int(tree.parents[b, node])
    return out[::-1]


@pytest.mark.parametrize("seed", range(20))
def test_merged_tree_holds_each_chain_as_a_path_and_keeps_the_tree(seed):
    B, N, k = 3, 7, 4
    tree = random_tree(B, N, seed)
    g = torch.Generator().manual_seed(100 + seed)
    contexts = [torch.randint(0, 6, (12,), generator=g).tolist() + [int(tree.tokens[b, 0])] for b in range(B)]
    out = add_lookup(tree, contexts, k)
    E = out.tokens.shape[1] - N
    assert torch.equal(out.tokens[:, :N], tree.tokens) and torch.equal(out.parents[:, :N], tree.parents)
    poss_ext.ops.tree_verify(out.parents, out.tokens, torch.randn(B, N + E, 6), None, None, None, None)  # valid
    for b in range(B):
        for i in range(N, N + E):
            p = int(out.parents[b, i])
            assert 0 <= p < i and int(out.depth[b, i]) == int(out.depth[b, p]) + 1
        chain = continuation(contexts[b], k)
        ends = [i for i in range(N + E) if path_tokens(out, b, i) == chain]
        assert chain == [] or ends, f"row {b}: the chain {chain} is not a path from the root"


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("with_spare", [False, True])
def test_a_narrow_tree_keeps_its_padding_last(seed, with_spare):
    # build_tree pads a row whose draft proposed fewer than num_nodes - 1 candidates (a depth-1 tree
    # wider than its beam): the chain's nodes must go before that padding, which the ops require
    B, N, k = 3, 7, 4
    tree = random_tree(B, N, seed)
    real = [N, 3, 5]  # rows 1 and 2 end in padding
    for b, n in enumerate(real):
        tree.tokens[b, n:], tree.parents[b, n:], tree.depth[b, n:] = 0, -2, 0
    g = torch.Generator().manual_seed(300 + seed)
    if with_spare:
        tree.spare = torch.randperm(40, generator=g)[:2 * B].view(B, 2) + 10
    contexts = [torch.randint(0, 6, (12,), generator=g).tolist() + [int(tree.tokens[b, 0])] for b in range(B)]
    out = add_lookup(tree, contexts, k)
    E = out.tokens.shape[1] - N
    assert E > 0 and (E == k or not with_spare)
    poss_ext.ops.tree_verify(out.parents, out.tokens, torch.randn(B, N + E, 50), None, None, None, None)  # valid
    for b, n in enumerate(real):
        assert torch.equal(out.tokens[b, :n], tree.tokens[b, :n])
        assert torch.equal(out.parents[b, :n], tree.parents[b, :n])
        assert out.parents[b, n + E:].tolist() == [-2] * (N - n), "padding moves behind the new nodes"
        for i in range(n, n + E):
            p = int(out.parents[b, i])
            assert 0 <= p < i and int(out.depth[b, i]) == int(out.depth[b, p]) + 1
        chain = continuation(contexts[b], k)
        assert chain == [] or any(path_tokens(out, b, i) == chain for i in range(n + E))


def test_lookup_after_a_padded_draft_tree():
    # the tree of CI's failure: a beam of 2 at depth 1 fills 3 of 6 nodes; the chain used to land behind the padding
    cand_tokens = torch.tensor([[4, 7]])
    tokens, parents, depth = poss_ext.ops.build_tree(cand_tokens, torch.tensor([[-0.1, -0.2]]),
                                                     torch.tensor([[-1, -1]], dtype=torch.int32),
                                                     torch.tensor([9]), 6)
    assert parents[0].tolist() == [-1, 0, 0, -2, -2, -2]
    out = add_lookup(Tree(tokens, parents, depth), [[9, 4, 1, 2, 9]], 3)  # chain after 9: [4, 1, 2]
    assert out.tokens[0].tolist() == [9, 4, 7, 1, 2, 0, 0, 0]
    assert out.parents[0].tolist() == [-1, 0, 0, 1, 3, -2, -2, -2]
    assert out.depth[0].tolist() == [0, 1, 1, 2, 3, 0, 0, 0]


def test_no_chain_leaves_the_tree_as_it_is():
    tree = random_tree(2, 5, 0)
    assert add_lookup(tree, [[1, 2, 3], [4, 5, 6]], 4) is tree


@pytest.mark.parametrize("seed", range(10))
def test_spare_tokens_fill_every_row_to_k_new_nodes(seed):
    B, N, k = 4, 5, 5
    tree = random_tree(B, N, seed)
    g = torch.Generator().manual_seed(200 + seed)
    tree.spare = torch.randperm(40, generator=g)[:3 * B].view(B, 3) + 10  # tokens no tree node holds
    contexts = [torch.randint(0, 6, (10,), generator=g).tolist() + [int(tree.tokens[b, 0])] for b in range(B)]
    contexts[0] = [7, 8]  # no earlier occurrence: row 0's rows all go to spare tokens, then padding
    out = add_lookup(tree, contexts, k)
    assert out.tokens.shape == (B, N + k)
    poss_ext.ops.tree_verify(out.parents, out.tokens, torch.randn(B, N + k, 50), None, None, None, None)
    for b in range(B):
        chain = continuation(contexts[b], k)
        roots = [i for i in range(N, N + k) if int(out.parents[b, i]) == 0 and int(out.tokens[b, i]) >= 10]
        fill = [int(out.tokens[b, i]) for i in roots]
        assert fill == tree.spare[b].tolist()[:len(fill)], "spare tokens fill in their order, best first"
        assert all(int(out.depth[b, i]) == 1 for i in roots)
        assert chain == [] or any(path_tokens(out, b, i) == chain for i in range(N + k))
    assert out.tokens[0, N:].tolist() == tree.spare[0].tolist() + [int(tree.tokens[0, 0])] * (k - 3)


def test_a_spare_token_equal_to_the_chain_head_is_skipped():
    i32 = dict(dtype=torch.int32)
    tree = Tree(torch.tensor([[5, 1]]), torch.tensor([[-1, 0]], **i32), torch.tensor([[0, 1]], **i32),
                spare=torch.tensor([[3, 4]]))
    out = add_lookup(tree, [[5, 3, 9, 2, 5]], 3)  # the chain after 5 is [3, 9, 2]: 3 is also the best spare
    assert out.tokens[0].tolist() == [5, 1, 3, 9, 2]
    out = add_lookup(tree, [[5, 3, 5]], 3)  # chain [3, 5]: one row left, and spare 3 would twin the chain head
    assert out.tokens[0].tolist() == [5, 1, 3, 5, 4] and out.parents[0].tolist() == [-1, 0, 0, 2, 0]


def test_lookup_bounds():
    with pytest.raises(ValueError, match="lookup must be in"):
        TreeParams(num_nodes=250, lookup=7)
    with pytest.raises(ValueError, match="lookup must be in"):
        TreeParams(lookup=-1)


@pytest.fixture(scope="module")
def target():
    model = tiny_target()  # its text soon cycles through a bigram map: lookups hit
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("draft", [True, False], ids=["poss2-plus-lookup", "lookup-only"])
def test_greedy_with_lookup_matches_hf(target, draft):
    prompts = eval_prompts(n_per_set=2)
    gen = make_generator(target, draft=draft, n=3, ppl=2, aligned=False)
    gen.end_ids = set()
    res = gen.generate(prompts, 96, tree=TreeParams(num_nodes=6, depth=2, beam_width=4, lookup=6) if draft
                       else TreeParams(num_nodes=1, depth=0, lookup=6))
    for p, got in zip(prompts, res.token_ids):
        assert got == hf_greedy(target, p, 96)
    # the random draft alone accepts at most 2 per round: longer accepted paths came from the lookup
    assert any(k > 2 and c for s in res.stats for k, c in enumerate(s.accept_hist))
    # draft_tokens counts the rows past the root: with a draft, the drafted ones plus the chain's 6
    # rows every round (spare draft tokens fill what a chain leaves); without, a chain where it matched
    if draft:
        assert all(s.draft_tokens == (5 + 6) * s.rounds for s in res.stats)
    else:
        assert all(0 <= s.draft_tokens <= 6 * s.rounds for s in res.stats)
        assert any(s.draft_tokens > 0 for s in res.stats)
    if draft:
        plain = gen.generate(prompts[:1], 16, tree=TreeParams(num_nodes=6, depth=2, beam_width=4)).stats[0]
        assert plain.draft_tokens == 5 * plain.rounds


def test_greedy_with_lookup_after_a_narrow_tree_matches_hf(target):
    # depth 1 and a beam of 4 propose 4 candidates for 7 rows: the draft tree ends in padding (CI's failure)
    prompts = eval_prompts(n_per_set=1)[:3]
    gen = make_generator(target, draft=True, n=3, ppl=2, aligned=False)
    gen.end_ids = set()
    res = gen.generate(prompts, 48, tree=TreeParams(num_nodes=8, depth=1, beam_width=4, lookup=3))
    for p, got in zip(prompts, res.token_ids):
        assert got == hf_greedy(target, p, 48)
    assert any(k > 1 and c for s in res.stats for k, c in enumerate(s.accept_hist)), "the chain was accepted"


@pytest.mark.parametrize("draft", [True, False], ids=["poss-n3-plus-lookup", "lookup-only"])
def test_sampling_with_lookup_follows_the_target(draft):
    model = tiny_target(vocab=V, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    probs = exact_distribution(model)
    gen = make_generator(model, draft=draft, n=3, ppl=1, aligned=True)
    tree = TreeParams(num_nodes=12, depth=3, beam_width=4, lookup=3) if draft else TreeParams(1, 0, lookup=3)
    counts, _ = sample(gen, 40, tree=tree)
    assert counts[probs == 0].sum() == 0
    assert chi2_pvalue(counts, probs) > 1e-3
