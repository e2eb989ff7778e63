"""Steps 2 and 3 of a round: verify the tree on the target, then commit what was accepted."""

from typing import Optional, Tuple

import torch
from torch import Tensor

import poss_ext
from poss.draft_tree import Tree
from poss.forward import target_forward


@torch.inference_mode()
def verify(runner, seq, tree: Tree, uniforms: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """One target forward over the tree's nodes (at positions ``L + depth``), then ``tree_verify``.

    Returns accept_nodes ``[B, N] int32``, accept_len ``[B] int32``, next_token ``[B] int64`` and the
    tree's target features ``[B, N, H]``. Lossless: greedy rows take the target's argmax path,
    sampling rows are exact for this deterministic draft (see ``poss_ext.ops.tree_verify``).
    """
    positions = seq.length_dev.long().unsqueeze(1) + tree.depth.long()
    logits, features = target_forward(runner, tree.tokens, positions, tree.parents, seq.length_dev)
    nodes, acc, nxt = poss_ext.ops.tree_verify(tree.parents, tree.tokens, logits, seq.temperature,
                                               seq.top_k, seq.top_p, uniforms)
    return nodes, acc, nxt, features


@torch.inference_mode()
def commit(runner, seq, tree: Tree, nodes: Tensor, acc: Tensor, nxt: Tensor, features: Tensor,
           max_accept: int) -> Tensor:
    """Keep the accepted path: compact the target KV, append tokens + bonus, store their features.

    ``max_accept`` bounds ``acc`` (the draft depth). Everything stays on the device; returns
    ``[B, 1 + max_accept + 1] int64`` = (accept_len, new tokens...), of which row b's first
    ``acc + 1`` tokens are real (the accepted draft tokens, then the bonus). The caller reads it
    back once per round.
    """
    B, N = tree.tokens.shape
    A = min(N, max_accept + 1)  # root + accepted nodes, at most
    poss_ext.ops.kv_compact(runner.cache.k[:, :B], runner.cache.v[:, :B], seq.length_dev, nodes, acc)
    i = torch.arange(A, device=nodes.device).unsqueeze(0)
    a = acc.long().unsqueeze(1)
    path = nodes[:, :A].long().clamp(min=0)  # node at depth i of the accepted path (garbage past acc)
    L = seq.length_dev.long().unsqueeze(1)
    if seq.feats is not None:  # the accepted nodes' target features feed the next round's draft
        H = features.shape[-1]
        got = features.gather(1, path.unsqueeze(-1).expand(B, A, H)).to(seq.feats.dtype)
        seq.feats.scatter_(1, (L + i).unsqueeze(-1).expand(B, A, H), got)
    child = torch.cat([path[:, 1:], torch.zeros_like(path[:, :1])], 1)
    new = torch.where(i < a, tree.tokens.gather(1, child), nxt.unsqueeze(1).expand(B, A))
    # Slots past acc + 1 get garbage that the next round overwrites before reading.
    seq.ids.scatter_(1, L + 1 + i, new)
    seq.length_dev += (acc + 1).to(seq.length_dev.dtype)
    return torch.cat([acc.long().unsqueeze(1), new], 1)
