"""poss.build_tree vs the reference and a batched torch-ops build (run:
pytest bench/bench_build_tree.py --benchmark-only).

Inputs are EAGLE-2 beams with the paper's defaults: top_k = 10, 5 expansions after the root
(M = 10 + 5 * 100 = 510 candidates), 60 tree nodes. The torch-ops baseline is EAGLE-2's rerank
batched over requests: topk + sort + gather, parent lookup by searchsorted, depth by pointer
jumping. It does not enforce ancestor closure on ties (EAGLE-2 does not either).

Threads: POSS_BENCH_THREADS (default 1). The 2-core development box is shared and usually
loaded, so a multi-threaded run there mostly measures how long the OS takes to schedule the second
OpenMP thread; single-threaded numbers are the stable ones.
"""


import math

import pytest
import torch

import poss_ext  # noqa: F401
from poss_ext import reference

K, DEPTH, NUM_NODES = 10, 5, 60


def eagle_beams(B, vocab=1000, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def logp(rows):
        return torch.log_softmax(torch.randn(rows, vocab, generator=gen) * 3, -1)

    scores_b, tokens_b, parents_b = [], [], []
    for _ in range(B):
        tp, ti = torch.topk(logp(1)[0], K)
        scores, cs_index = tp, torch.arange(K)
        s_list, t_list, p_list = [tp], [ti], [torch.full((K,), -1)]
        for i in range(DEPTH):
            frontier = cs_index + (0 if i == 0 else K + K * K * (i - 1))
            tp, ti = torch.topk(logp(K), K, dim=-1)
            cu = tp + scores[:, None]
            scores, cs_index = torch.topk(cu.flatten(), K)
            s_list.append(cu.flatten())
            t_list.append(ti.flatten())
            p_list.append(frontier.repeat_interleave(K))
        scores_b.append(torch.cat(s_list))
        tokens_b.append(torch.cat(t_list))
        parents_b.append(torch.cat(p_list))
    roots = torch.randint(0, vocab, (B,), generator=gen)
    return torch.stack(tokens_b), torch.stack(scores_b).float(), torch.stack(parents_b).int(), roots


def torch_ops_build_tree(cand_tokens, cand_scores, cand_parents, root_token, num_nodes):
    B = cand_tokens.shape[0]
    T = num_nodes - 1
    top = torch.topk(cand_scores, T, dim=-1).indices.sort(dim=-1).values
    tokens = torch.cat([root_token[:, None], cand_tokens.gather(1, top)], 1)
    par_cand = cand_parents.gather(1, top).long()
    par_node = torch.searchsorted(top, par_cand.clamp_min(0)) + 1
    par_node = torch.where(par_cand < 0, torch.zeros_like(par_node), par_node)
    parents = torch.cat([torch.full((B, 1), -1, dtype=torch.long), par_node], 1)
    # Depth by pointer jumping: dist to the current jump target, target <- target's target.
    jump = parents.clamp_min(0)
    dist = (parents >= 0).long()
    for _ in range(math.ceil(math.log2(num_nodes)) + 1):
        dist = dist + dist.gather(1, jump)
        jump = jump.gather(1, jump)
    return tokens, parents.int(), dist.int()


pytestmark = pytest.mark.usefixtures("bench_threads")


IMPLS = {
    "poss": torch.ops.poss.build_tree,
    "torch_ops": torch_ops_build_tree,
    "reference": reference.build_tree,
}


def test_torch_ops_baseline_agrees():
    args = eagle_beams(4, seed=1)
    for got, want in zip(torch_ops_build_tree(*args, NUM_NODES), torch.ops.poss.build_tree(*args, NUM_NODES)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("B", [1, 16, 64])
def test_build_tree(benchmark, B, impl):
    args = eagle_beams(B)
    benchmark.group = f"build_tree M={args[0].shape[1]} num_nodes={NUM_NODES} B={B}"
    rounds = 3 if impl == "reference" else 50
    benchmark.pedantic(IMPLS[impl], args=(*args, NUM_NODES), rounds=rounds, warmup_rounds=1)
