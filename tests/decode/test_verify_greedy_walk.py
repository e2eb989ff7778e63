"""The lazy greedy walk of ``poss.decode.verify`` against ``torch.ops.poss.tree_verify`` on full logits.

The walk asks for a node's logits only when it reaches the node; its outputs must be the op's, tie
rule included, and it must ask for exactly the nodes on the accepted paths.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import poss_ext
from helpers.loop import eval_prompts, make_generator, single_thread, tiny_target  # noqa: F401  (autouse fixture)
from helpers.tree_cases import make_case
from poss.decode import verify as verify_mod
from poss.decode.draft_tree import Tree


def tie_some_maxima(rng, logits: torch.Tensor) -> None:
    """Copy each of some rows' maximum to a random other token, so the lowest-id rule decides."""
    B, N, V = logits.shape
    for b in range(B):
        for n in range(N):
            if V > 1 and rng.random() < 0.5:
                logits[b, n, rng.integers(0, V)] = logits[b, n].max()


def tree_of(parents, tokens) -> Tree:
    return Tree(tokens, parents, torch.zeros_like(parents))


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), B=st.integers(1, 10), N=st.integers(1, 40),
       V=st.sampled_from([1, 2, 7, 300]), shape=st.sampled_from(["random", "chain", "star"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_walk_equals_tree_verify_and_reads_only_the_path(seed, B, N, V, shape, dtype):
    rng = np.random.default_rng(seed)
    parents, tokens, logits = make_case(rng, B, N, V, shape)
    tie_some_maxima(rng, logits)
    logits = logits.to(dtype)
    asked = []

    def row_logits(req, node):
        asked.extend(zip(req.tolist(), node.tolist()))
        return logits[req, node]

    got = verify_mod.greedy_walk(tree_of(parents, tokens), row_logits)
    want = poss_ext.ops.tree_verify(parents, tokens, logits, None, None, None, None)
    for g, w, name in zip(got, want, ("accept_nodes", "accept_len", "next_token")):
        assert torch.equal(g, w), f"{name}: walk {g} vs op {w}"
    nodes, acc, _ = want
    path = {(b, int(nodes[b, i])) for b in range(B) for i in range(int(acc[b]) + 1)}
    assert sorted(asked) == sorted(path), "the walk must read exactly the accepted paths' nodes"


def test_nan_on_the_path_names_the_row():
    parents = torch.tensor([[-1, 0, 1]], dtype=torch.int32)
    tokens = torch.tensor([[0, 2, 1]])
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = 1.0  # root -> node 1 accepted
    logits[0, 1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"logits\[0, 1\] contains NaN"):
        verify_mod.greedy_walk(tree_of(parents, tokens), lambda r, n: logits[r, n])


def test_lazy_only_for_greedy_cpu_trees_of_enough_rows():
    cpu = torch.device("cpu")
    rows = verify_mod.LAZY_LM_HEAD_MIN_ROWS
    assert verify_mod.walks_lazily(cpu, rows, None)
    assert not verify_mod.walks_lazily(cpu, rows - 1, None)
    assert not verify_mod.walks_lazily(torch.device("cuda"), rows, None)
    assert not verify_mod.walks_lazily(cpu, rows, sampling=object())


def test_generation_is_the_same_with_and_without_the_lazy_walk(monkeypatch):
    """Same tokens and the same accepted lengths per round, with batch rows of different lengths."""
    gen = make_generator(tiny_target(), draft=True, n=3, ppl=2, aligned=True)
    prompts = eval_prompts(n_per_set=1)
    runs = []
    for min_rows in (1, 10**9):  # always lazy, never lazy
        monkeypatch.setattr(verify_mod, "LAZY_LM_HEAD_MIN_ROWS", min_rows)
        res = gen.generate(prompts, 48, num_nodes=16, depth=4)
        runs.append((res.token_ids, [s.accept_hist for s in res.stats]))
    assert runs[0] == runs[1]
    assert max(k for hist in runs[0][1] for k, c in enumerate(hist) if c) >= 2  # deep paths were walked
