"""Steps 2 and 3 of a round: verify the tree on the target, then commit what was accepted."""

from typing import Optional, Tuple

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


@torch.inference_mode()
def verify(runner, batch: BatchState, tree: Tree, uniforms: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """One target forward over the tree's nodes (at positions ``L + depth``), then ``tree_verify``.

    Returns accept_nodes ``[B, N] int32``, accept_len ``[B] int32``, next_token ``[B] int64`` and the
    tree's target features ``[B, N, H]``. Lossless: greedy rows take the target's argmax path,
    sampling rows are exact for this deterministic draft (see ``poss_ext.ops.tree_verify``).
    """
    positions = batch.length_dev.long().unsqueeze(1) + tree.depth.long()
    # The generator sized the cache for the whole call, so no per-round capacity check (a host sync).
    logits, features = runner.forward(tree.tokens, positions, tree.parents, batch.length_dev, check_capacity=False)
    nodes, acc, nxt = tree_verify(tree, logits, batch.sampling, uniforms)
    return nodes, acc, nxt, features


@torch.inference_mode()
def commit(runner, batch: BatchState, tree: Tree, nodes: Tensor, acc: Tensor, nxt: Tensor, features: Tensor,
           max_accept: int) -> Tensor:
    """Keep the accepted path: compact the target KV, append tokens + bonus, store their features.

    ``max_accept`` bounds ``acc`` (the draft depth). Everything stays on the device; returns
    ``[B, 1 + max_accept + 1] int64`` = (accept_len, new tokens...), of which row b's first
    ``acc + 1`` tokens are real (the accepted draft tokens, then the bonus). The caller reads it
    back once per round.
    """
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
        batch.feats.scatter_(1, (L + i).unsqueeze(-1).expand(B, A, H), got)
    child = torch.cat([path[:, 1:], torch.zeros_like(path[:, :1])], 1)
    new = torch.where(i < a, tree.tokens.gather(1, child), nxt.unsqueeze(1).expand(B, A))
    # Slots past acc + 1 get garbage that the next round overwrites before reading.
    batch.ids.scatter_(1, L + 1 + i, new)
    batch.length_dev += (acc + 1).to(batch.length_dev.dtype)
    return torch.cat([acc.long().unsqueeze(1), new], 1)
