"""A preallocated static KV cache shared by every layer of a model: ``[L, B, Hkv, S_max, D]``."""

import torch
from torch import Tensor


class StaticKVCache:
    """K and V for ``num_layers`` layers, written in place by the fused layer ops.

    The cache does not track lengths: the caller owns each row's committed prefix length ``L`` (the
    decoding loop keeps it on the host and on the device). Slots at and past ``L`` hold the tree of the
    current step (node i at slot ``L + i``) or garbage, and are never read as prefix.
    """

    def __init__(self, k: Tensor, v: Tensor):
        """A cache over existing ``k`` / ``v`` tensors ``[L, B, Hkv, S_max, D]`` (see :meth:`zeros`)."""
        if k.shape != v.shape or k.dim() != 5:
            raise ValueError(f"k and v must be [L, B, Hkv, S_max, D] of one shape, got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        self.k, self.v = k, v

    @classmethod
    def zeros(cls, num_layers: int, batch: int, kv_heads: int, max_seq: int, head_dim: int,
              dtype: torch.dtype, device) -> "StaticKVCache":
        """A new zero-filled cache of ``batch`` rows and ``max_seq`` slots per layer."""
        shape = (num_layers, batch, kv_heads, max_seq, head_dim)
        cache = cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        if cache.k.is_cuda:
            # The layer ops write the cache in place. Under torch.compile(mode="reduce-overhead") a
            # CUDA graph may mutate only inputs at a fixed address, and skips graphs for any other
            # mutated input. A cache lives as long as its runner; a grown cache is a new tensor, and
            # the guard recompiles for it.
            from torch._dynamo import mark_static_address

            mark_static_address(cache.k, guard=True)
            mark_static_address(cache.v, guard=True)
        return cache

    def rows(self, start: int) -> "StaticKVCache":
        """A cache whose row 0 is this cache's row ``start``: a view, so writes land in this cache (the
        decoding engine prefills newly admitted requests into the free rows this way)."""
        return StaticKVCache(self.k[:, start:], self.v[:, start:])

    @property
    def max_seq(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def layer(self, i: int):
        """``(k, v)`` of layer i, each a contiguous ``[B, Hkv, S_max, D]`` view."""
        return self.k[i], self.v[i]

    def grown(self, batch: int, max_seq: int) -> "StaticKVCache":
        """This cache when it holds ``batch`` rows of ``max_seq`` slots, else a larger empty one."""
        if self.batch >= batch and self.max_seq >= max_seq:
            return self
        L, _, Hkv, _, D = self.k.shape
        return StaticKVCache.zeros(L, max(batch, self.batch), Hkv, max(max_seq, self.max_seq), D, self.k.dtype,
                                   self.k.device)

    def check_fits(self, prefix_len: Tensor, num_nodes: int) -> None:
        """Raise a clear error when ``num_nodes`` more slots do not fit behind ``prefix_len [B] int32``.

        Reads ``prefix_len`` back to the host: one device sync.
        """
        need = int((prefix_len.to("cpu", torch.int64) + num_nodes).max())
        if need > self.max_seq:
            raise ValueError(
                f"sequence needs {need} KV slots but the cache holds max_seq={self.max_seq}; "
                "shorten the prompt or build the runner with a larger max_seq"
            )
