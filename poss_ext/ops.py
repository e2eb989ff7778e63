"""Typed Python wrappers of the poss ops, with their fake (meta) kernels.

Tree encoding shared by every op: per request ``b``, ``N`` nodes in topological order. Node 0 is
the root (the last committed token); ``parents[b, 0] = -1``, ``0 <= parents[b, i] < i`` for real
nodes, and padding nodes carry ``-2`` after the real ones.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from poss_ext import reference



def tree_verify(
    parents: Tensor,
    tokens: Tensor,
    logits: Tensor,
    temperature: Optional[Tensor] = None,
    top_k: Optional[Tensor] = None,
    top_p: Optional[Tensor] = None,
    uniforms: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Accept the longest valid path of a draft tree against the target's logits.

    Args:
        parents: ``[B, N] int32``, the tree (shared encoding above).
        tokens: ``[B, N] int64``; ``tokens[b, 0]`` is the root token.
        logits: ``[B, N, V]`` float32 / bfloat16 / float16, the target's logits at each node
            (they predict the node's children).
        temperature: ``[B] float32``; ``None`` or 0 for a request means greedy.
        top_k: ``[B] int32``, 0 = off.
        top_p: ``[B] float32``, 1.0 = off.
        uniforms: ``[B, N + 1] float32`` in ``[0, 1)``; ``uniforms[b, i]`` decides node ``i``,
            ``uniforms[b, N]`` draws the next token. Required when any temperature > 0.

    Returns:
        accept_nodes: ``[B, N] int32``, node ids of the accepted path, root first, then -1.
        accept_len: ``[B] int32``, accepted draft tokens (root not counted).
        next_token: ``[B] int64``, the bonus / correction token after the accepted path.

    Greedy descends to the first child (node order) whose token is the argmax (lowest id on ties).
    Sampling is exact for deterministic drafts: p = top_p(top_k(softmax(logits / T))); child x is
    accepted when ``u < p(x) / remaining mass``, a rejected child's mass is removed, and the next
    token is drawn from what remains (or from p itself at a leaf).
    """
    return torch.ops.poss.tree_verify(parents, tokens, logits, temperature, top_k, top_p, uniforms)


def _check_same_device(ref: Tensor, **tensors: Optional[Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None:
            torch._check(
                t.device == ref.device,
                lambda: f"{name} must be on the same device as parents ({ref.device}), got {t.device}",
            )


@torch.library.register_fake("poss::tree_verify")
def _tree_verify_fake(parents, tokens, logits, temperature=None, top_k=None, top_p=None, uniforms=None):
    torch._check(parents.dim() == 2, lambda: "parents must be [B, N] int32")
    _check_same_device(parents, tokens=tokens, logits=logits, temperature=temperature, top_k=top_k,
                       top_p=top_p, uniforms=uniforms)
    B, N = parents.shape
    return (
        parents.new_empty((B, N), dtype=torch.int32),
        parents.new_empty((B,), dtype=torch.int32),
        parents.new_empty((B,), dtype=torch.int64),
    )


def _register_fallbacks(build_info: dict) -> None:
    """Serve the ops on CUDA tensors with the pure-PyTorch references when no CUDA kernel was built."""
    if build_info["cuda"]:
        return
    torch.library.register_kernel("poss::tree_verify", "CUDA", reference.tree_verify)
