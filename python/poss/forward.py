"""Sync-free forwards of the two models, as the loop calls them.

``TargetRunner.forward`` and ``PosSDraft.step`` check cache capacity by reading ``prefix_len`` back
to the host, one device sync per call. The loop knows every length on the host already (it reads
the accept lengths once per round), so it checks capacity once per round itself and calls the
fused ops directly through these adapters.
"""

import torch
from torch import Tensor, nn

import poss_ext


def target_forward(runner, tokens: Tensor, positions: Tensor, parents: Tensor, prefix_len: Tensor):
    """The target over the last T nodes of ``parents`` behind ``prefix_len``; no host sync.

    tokens / positions ``[B, T] int64``, parents ``[B, N] int32``, prefix_len ``[B] int32``.
    Returns logits ``[B, T, V]`` and features ``[B, T, H]`` (after the final norm), runner dtype.
    """
    features = runner.hidden(tokens, positions, parents, prefix_len)
    return features @ runner.lm_head.t(), features


def specialist_step(draft, j: int, tokens: Tensor, features: Tensor, positions: Tensor, parents: Tensor,
                    prefix_len: Tensor) -> Tensor:
    """Specialist ``j`` over the last T nodes of ``parents`` on its own KV cache; no host sync.

    tokens ``[B, T] int64`` (x_{t+1}), features ``[B, T, H]`` (f_t, target or draft), positions
    ``[B, T] int64``, parents ``[B, N] int32``, prefix_len ``[B] int32`` (j's committed pairs).
    Returns the specialist's output features ``[B, T, H]``.
    """
    embed, _, inv_freq = draft.target
    B = tokens.shape[0]
    k, v = draft.caches.layer(j)
    c = draft.config
    e = nn.functional.embedding(tokens, embed).to(features.dtype)
    return poss_ext.ops.specialist_forward(
        e, features, draft.fc.weight, draft.fc.bias, *draft.layers[j].fused_weights(), k[:B], v[:B],
        prefix_len, parents, positions, inv_freq, c.heads, c.kv_heads, c.rms_eps)


def draft_log_probs(draft, out_features: Tensor) -> Tensor:
    """``log_softmax`` of the target lm_head over draft features ``[..., H]`` -> ``[..., V] float32``."""
    return torch.log_softmax(draft.logits(out_features).float(), dim=-1)
