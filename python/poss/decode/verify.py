"""Steps 2 and 3 of a round: verify the tree on the target, then commit what was accepted."""

from typing import Callable, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

import poss_ext
from poss.decode.batch import BatchState
from poss.decode.draft_tree import Tree
from poss.decode.params import SamplingTensors


def tree_verify(tree: Tree, logits: Tensor, sampling: Optional[SamplingTensors],
                uniforms: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """``poss_ext.ops.tree_verify`` with the batch's sampling parameters (None: all rows greedy).

    logits ``[B, N, V]`` of the tree's nodes, uniforms ``[B, N + 1] float32`` (None when greedy).
    Returns accept_nodes ``[B, N] int32``, accept_len ``[B] int32`` and next_token ``[B] int64``.
    """
    if sampling is None:
        return poss_ext.ops.tree_verify(tree.parents, tree.tokens, logits, None, None, None, None)
    extra = {} if sampling.min_p is None else {"min_p": sampling.min_p}  # only ops that know min-p get it
    return poss_ext.ops.tree_verify(tree.parents, tree.tokens, logits, sampling.temperature, sampling.top_k,
                                    sampling.top_p, uniforms, **extra)


# On a CPU the lm_head over all B*N tree rows is compute-bound (SmolLM2, bf16, one core: 19 ms for
# 60 rows), while a greedy walk needs only the rows on the accepted path: one GEMM of <= B rows per
# level, each about one pass over the weights (1.8 ms). Up to 12 rows our GEMM streams the weights
# once (2.4 ms for 12 rows against 2.9 for a two-level walk; 3.1 against 2.8 at 13), so the walk's
# extra passes do not pay there. (bench/bench_lm_head_walk.py, AVX512-BF16 EPYC, 2026-12-04)
LAZY_LM_HEAD_MIN_ROWS = 13


def walks_lazily(logits_device: torch.device, rows: int, sampling: Optional[SamplingTensors]) -> bool:
    """Whether :func:`verify` computes only the walked rows' logits: greedy batches on a CPU, where a
    level's host sync is free, with at least ``LAZY_LM_HEAD_MIN_ROWS`` tree rows."""
    return sampling is None and logits_device.type == "cpu" and rows >= LAZY_LM_HEAD_MIN_ROWS


def greedy_walk(tree: Tree, row_logits: Callable[[Tensor, Tensor], Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """Greedy ``tree_verify`` that asks for a node's logits only when the walk reaches it.

    ``row_logits(requests [R] int64, nodes [R] int64) -> [R, V]`` gives the target's logits at node
    ``nodes[r]`` of request ``requests[r]``. All requests walk level by level, so each level is one
    call. Same outputs as ``poss_ext.ops.tree_verify`` (greedy) on the full logits: the lowest token
    id among tied maxima, children tried in node order.
    """
    B, N = tree.tokens.shape
    dev = tree.tokens.device
    nodes = torch.full((B, N), -1, dtype=torch.int32, device=dev)
    nodes[:, 0] = 0
    acc = torch.zeros(B, dtype=torch.int32, device=dev)
    nxt = torch.empty(B, dtype=torch.int64, device=dev)
    node_ids = torch.arange(N, device=dev)
    req = torch.arange(B, device=dev)
    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    while req.numel():
        # In fp32: torch's bf16 argmax and isnan run at a fifth of the speed on the CPU (260 against 42
        # us for one 49k-token row). max returns the first maximal index, and NaN where a row has one.
        top, best = row_logits(req, cur).float().max(1)
        if top.isnan().any():
            r = int(top.isnan().nonzero()[0, 0])
            raise ValueError(f"tree_verify: logits[{int(req[r])}, {int(cur[r])}] contains NaN")
        match = ((tree.parents[req] == cur.unsqueeze(1)) & (tree.tokens[req] == best.unsqueeze(1))
                 & (node_ids > cur.unsqueeze(1)))
        found = match.any(1)
        child = torch.where(match, node_ids, N).amin(1)
        nxt[req[~found]] = best[~found]
        req, cur = req[found], child[found]
        acc[req] += 1
        nodes[req, acc[req].long()] = cur.int()
    return nodes, acc, nxt


class Verdict(NamedTuple):
    """What :func:`verify` decided for a round, as :func:`commit` takes it (row b: request b).

    nodes ``[B, N] int32``: the accepted path's node ids, root first (-1 past it); accept_len ``[B] int32``:
    accepted draft tokens; next_token ``[B] int64``: the bonus token after them; features ``[B, N, H]``:
    the target's final-norm features of every tree node (the runner's dtype).
    """

    nodes: Tensor
    accept_len: Tensor
    next_token: Tensor
    features: Tensor


@torch.inference_mode()
def verify(runner, batch: BatchState, tree: Tree, uniforms: Optional[Tensor]) -> Verdict:
    """One target forward over the tree's nodes (at positions ``L + depth``), then ``tree_verify``.

    Lossless: greedy rows take the target's argmax path, sampling rows are exact for this deterministic
    draft (see ``poss_ext.ops.tree_verify``). ``uniforms``: ``[B, N + 1] float32``, None when all rows
    are greedy.
    """
    positions = batch.length_dev.long().unsqueeze(1) + tree.depth.long()
    lazy = walks_lazily(runner.device, tree.tokens.numel(), batch.sampling)
    # The generator sized the cache for the whole call, so no per-round capacity check (a host sync).
    logits, features = runner.forward(tree.tokens, positions, tree.parents, batch.length_dev,
                                      check_capacity=False, logits=not lazy)
    if lazy:  # a walked row's logits come from a GEMM of <= B rows, as in a decode step
        nodes, acc, nxt = greedy_walk(tree, lambda req, node: runner.logits(features[req, node]))
    else:
        nodes, acc, nxt = tree_verify(tree, logits, batch.sampling, uniforms)
    return Verdict(nodes, acc, nxt, features)


@torch.inference_mode()
def commit(runner, batch: BatchState, tree: Tree, verdict: Verdict, max_accept: int) -> Tensor:
    """Keep the accepted path: compact the target KV, append tokens + bonus, store their features.

    ``max_accept`` bounds the accept lengths (the draft depth plus the lookup chain). Everything stays
    on the device; returns ``[B, 1 + max_accept + 1] int64`` = (accept_len, new tokens...), of which
    row b's first ``acc + 1`` tokens are real (the accepted draft tokens, then the bonus). The caller
    reads it back once per round.
    """
    nodes, acc, nxt, features = verdict
    B, N = tree.tokens.shape
    A = min(N, max_accept + 1)  # root + accepted nodes, at most
    poss_ext.ops.kv_compact(runner.cache.k[:, :B], runner.cache.v[:, :B], batch.length_dev, nodes, acc)
    i = torch.arange(A, device=nodes.device).unsqueeze(0)
    a = acc.long().unsqueeze(1)
    path = nodes[:, :A].long().clamp(min=0)  # node at depth i of the accepted path (garbage past acc)
    L = batch.length_dev.long().unsqueeze(1)
    if batch.feats is not None:  # the accepted nodes' target features feed the next round's draft
        H = features.shape[-1]
        got = features.gather(1, path.unsqueeze(-1).expand(B, A, H)).to(batch.feats.dtype)
        # Indexed assignment, not scatter_ over an expanded index: on the CPU that copied the whole
        # [B, capacity, H] buffer twice, 1.4 ms a round at batch 16 (430 slots) against 22 us.
        rows = torch.arange(B, device=nodes.device).unsqueeze(1)
        batch.feats[rows, L + i] = got
    child = torch.cat([path[:, 1:], torch.zeros_like(path[:, :1])], 1)
    new = torch.where(i < a, tree.tokens.gather(1, child), nxt.unsqueeze(1).expand(B, A))
    # Slots past acc + 1 get garbage that the next round overwrites before reading.
    batch.ids.scatter_(1, L + 1 + i, new)
    batch.length_dev += (acc + 1).to(batch.length_dev.dtype)
    return torch.cat([acc.long().unsqueeze(1), new], 1)
