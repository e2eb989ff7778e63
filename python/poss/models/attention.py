"""The one place that decides which ``poss::tree_attention`` kernel the models run on.

Everything (the target runner and the fused C++ decoder layer) calls ``torch.ops.poss.tree_attention``
through the dispatcher. Until the compiled kernel for a device exists, :func:`ensure_tree_attention`
registers :func:`dense_tree_attention` (SDPA with a dense tree mask) as that device's kernel, so the
switch to the real kernel needs no change here or anywhere else.
"""

import torch
from torch import Tensor
import torch.nn.functional as F

PAD = -2


def tree_ancestor_mask(parents: Tensor) -> Tensor:
    """``[B, N, N] bool``: ``m[b, i, j]`` iff node j is node i or one of its ancestors.

    Padding nodes (-2) see only themselves. Transitive closure by repeated squaring: log2(N) GEMMs.
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
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
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


def ensure_tree_attention() -> None:
    """Serve ``poss::tree_attention`` with :func:`dense_tree_attention` on devices lacking a kernel."""
    import poss_ext  # noqa: F401  (registers the op schemas)

    for key in ("CPU", "CUDA"):
        if not torch._C._dispatch_has_kernel_for_dispatch_key("poss::tree_attention", key):
            torch.library.register_kernel("poss::tree_attention", key, dense_tree_attention)
