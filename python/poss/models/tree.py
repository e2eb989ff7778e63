"""Trees as every poss op encodes them, and the eager attention over one.

A batch of trees is ``parents [B, N] int32``: node 0 is the root (parent ``ROOT = -1``), every other
real node names an earlier node as its parent, and ``PAD = -2`` marks padding nodes (ragged batches);
both come from :mod:`poss_ext.limits`.
A prefill is a chain (parent of i is i - 1). :func:`dense_tree_attention` is the eager, differentiable
``tree_attention`` the eager specialist uses; ``poss_ext.reference`` keeps its own copy on purpose
(it is the test oracle of the kernels and must not share code with what it checks).
"""

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from poss_ext.limits import PAD


def chain_parents(lengths: Sequence[int], width: int, device=None) -> Tensor:
    """``[B, width] int32`` chain trees (parent of i is i-1) of the given lengths, padded with ``PAD``."""
    idx = torch.arange(width, dtype=torch.int32).expand(len(lengths), width) - 1
    lens = torch.tensor(list(lengths), dtype=torch.int32).unsqueeze(1)
    return torch.where(idx + 1 < lens, idx, torch.full_like(idx, PAD)).contiguous().to(device)


def tree_ancestor_mask(parents: Tensor) -> Tensor:
    """``[B, N, N] bool``: ``m[b, i, j]`` iff node j is node i or one of its ancestors.

    Padding nodes (``PAD``) see only themselves. Transitive closure by repeated squaring: log2(N) GEMMs.
    """
    B, N = parents.shape
    eye = torch.eye(N, dtype=torch.bool, device=parents.device).expand(B, N, N)
    valid = parents >= 0
    onehot = F.one_hot(parents.clamp(min=0).long(), N).bool() & valid.unsqueeze(-1)
    reach = (eye | onehot).float()
    steps = 1
    while steps < N:
        reach = (reach @ reach).clamp_(max=1.0)
        steps *= 2
    return reach > 0


def dense_tree_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, prefix_len: Tensor,
                         parents: Tensor, scale: float) -> Tensor:
    """Pure-PyTorch ``tree_attention`` with the op's exact signature (see ``poss_ext.ops``).

    q ``[B, Hq, Nq, D]`` (the tree's last Nq nodes), caches ``[B, Hkv, S, D]``, prefix_len ``[B] int32``,
    parents ``[B, N] int32``; node i's K/V sit at slot ``prefix_len + i``. Returns ``[B, Hq, Nq, D]``.
    """
    B, Hq, Nq, D = q.shape
    Hkv = k_cache.shape[1]
    N = parents.shape[1]
    pre = prefix_len.long()
    span = int((pre + N).max())  # slots past this are never visible
    slots = torch.arange(span, device=q.device)
    anc = tree_ancestor_mask(parents)[:, N - Nq:]  # [B, Nq, N]
    node = slots.view(1, 1, span) - pre.view(B, 1, 1)  # node index of each slot, <0 for prefix
    in_tree = (node >= 0) & (node < N)
    tree_vis = torch.gather(anc, 2, node.clamp(0, N - 1).expand(B, Nq, span)) & in_tree
    mask = (node < 0) | tree_vis  # [B, Nq, span]
    rep = Hq // Hkv
    k = k_cache[:, :, :span].repeat_interleave(rep, dim=1)
    v = v_cache[:, :, :span].repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=scale)
