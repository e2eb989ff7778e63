"""A preallocated static KV cache shared by every layer of a model: ``[L, B, Hkv, S_max, D]``."""

import torch
from torch import Tensor


class StaticKVCache:
    """K and V for ``num_layers`` layers, written in place by the fused decoder layer.

    ``lengths [B] int32`` is the committed prefix per request; slots at and past it hold the tree
    of the current step (node i at slot ``lengths + i``) or garbage, and are never read as prefix.
    """

    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_seq: int, head_dim: int,
                 dtype: torch.dtype, device):
        shape = (num_layers, batch, kv_heads, max_seq, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=device)

    @property
    def max_seq(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def layer(self, i: int):
        """``(k, v)`` of layer i, each a contiguous ``[B, Hkv, S_max, D]`` view."""
        return self.k[i], self.v[i]

    def check_fits(self, prefix_len: Tensor, num_nodes: int) -> None:
        """Raise a clear error when ``num_nodes`` more slots do not fit behind ``prefix_len``."""
        need = int((prefix_len.to("cpu", torch.int64) + num_nodes).max())
        if need > self.max_seq:
            raise ValueError(
                f"sequence needs {need} KV slots but the cache holds max_seq={self.max_seq}; "
                "shorten the prompt or build the runner with a larger max_seq"
            )

    def reset(self) -> None:
        self.lengths.zero_()
