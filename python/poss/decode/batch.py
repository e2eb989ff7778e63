"""The state of a decoding batch: committed lengths, token and feature history, cache rows.

Row ``b`` of every cache and buffer belongs to the request ``requests[b]``. Active requests always
occupy rows ``0 .. B-1``: when one finishes, the last active row moves into its place, so every
op keeps running on leading slices (``cache[:B]``) and a finished request costs nothing.

Per row, with ``L`` the committed length (tokens ``x_0 .. x_{L-1}`` have target K/V in the cache):
- ``ids[b, :L+1]`` holds ``x_0 .. x_L``; ``x_L`` is the round's root (the last bonus token), not yet
  in the target cache.
- ``feats[b, t]`` is the target's feature ``f_t`` for ``t < L``.
- ``draft_len[b]`` pairs ``(x_{t+1}, f_t)`` are in every specialist's cache; the draft catches up
  on ``t in [draft_len, L)`` at the start of a round.
"""

from dataclasses import dataclass, field
from typing import List, Optional

import torch
from torch import Tensor

from poss.decode.params import SamplingParams, SamplingTensors
from poss.models.kv_cache import StaticKVCache


@dataclass
class Request:
    """Host-side bookkeeping of one prompt."""

    index: int  # position in the caller's prompt list
    prompt: List[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generated: List[int] = field(default_factory=list)
    accept_hist: List[int] = field(default_factory=list)  # [k]: rounds that accepted k draft tokens
    draft_tokens: int = 0  # tree nodes proposed past the root, over all rounds (drafted and looked up)
    finished: bool = False
    finish_reason: Optional[str] = None
    seconds: float = 0.0
    text_end: Optional[int] = None  # set when a stop string cut the text
    features: Optional[Tensor] = None  # [P + n - 1, H], kept when the generator keeps features


def check_request(prompt: List[int], max_new_tokens: int, vocab: int, context_limit: int,
                  name: str = "the prompt") -> None:
    """``ValueError`` (its message starting with ``name``) for a request the loop cannot run: an empty
    prompt, a token id outside ``[0, vocab)``, no room under ``context_limit``, a negative budget."""
    if not prompt:
        raise ValueError(f"{name} is empty: there is no token to continue from")
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"{name} has token id {bad}, outside the vocabulary [0, {vocab})")
    if len(prompt) >= context_limit:
        raise ValueError(f"{name} has {len(prompt)} tokens, at or over the context limit of {context_limit}: "
                         "no room to generate")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")


class BatchState:
    """Device buffers for ``requests`` (rows in order) plus the host mirror of their lengths.

    ids ``[B, capacity] int64``; feats ``[B, capacity, H]`` (the runner's dtype) or None when nothing
    reads them; length_dev / draft_len_dev ``[B] int32`` with host mirrors ``length`` / ``draft_len``;
    ``sampling``: the requests' :class:`SamplingTensors`, None when all are greedy.
    """

    def __init__(self, requests: List[Request], hidden: int, capacity: int, feat_dtype, device, with_feats: bool):
        B = len(requests)
        self.requests = list(requests)
        self.ids = torch.zeros(B, capacity, dtype=torch.int64, device=device)
        self.feats = torch.zeros(B, capacity, hidden, dtype=feat_dtype, device=device) if with_feats else None
        self.length = [0] * B  # host mirror of length_dev
        self.draft_len = [0] * B
        self.length_dev = torch.zeros(B, dtype=torch.int32, device=device)
        self.draft_len_dev = torch.zeros(B, dtype=torch.int32, device=device)
        self.sampling = SamplingTensors.build([r.sampling for r in requests], device)

    @property
    def size(self) -> int:
        """Active rows ``B``."""
        return len(self.requests)

    def root_tokens(self) -> Tensor:
        """``[B] int64``: ``x_L`` of every row."""
        return self.ids.gather(1, self.length_dev.long().unsqueeze(1)).squeeze(1)

    def drop_finished(self, caches: List[StaticKVCache]) -> None:
        """Remove finished rows, moving the last active row into each hole (caches included)."""
        b = 0
        while b < self.size:
            if not self.requests[b].finished:
                b += 1
                continue
            last = self.size - 1
            if b != last:
                used = max(self.length[last], self.draft_len[last]) + 1
                for c in caches:
                    c.k[:, b, :, :used] = c.k[:, last, :, :used]
                    c.v[:, b, :, :used] = c.v[:, last, :, :used]
                for t in (self.ids, self.feats, self.length_dev, self.draft_len_dev):
                    if t is not None:
                        t[b] = t[last]
                if self.sampling is not None:
                    self.sampling.move_row(b, last)
                self.requests[b] = self.requests[last]
                self.length[b], self.draft_len[b] = self.length[last], self.draft_len[last]
            self.requests.pop()
            self.length.pop()
            self.draft_len.pop()
            # Row ``last`` is dead; the buffers keep their size, every op reads the leading B rows.
            self._shrink()

    @property
    def capacity(self) -> int:
        return self.ids.shape[1]

    def grow_capacity(self, capacity: int) -> None:
        """Make ``ids`` / ``feats`` hold ``capacity`` slots per row (contents kept)."""
        extra = capacity - self.capacity
        if extra <= 0:
            return
        self.ids = torch.nn.functional.pad(self.ids, (0, extra))
        if self.feats is not None:
            self.feats = torch.nn.functional.pad(self.feats, (0, 0, 0, extra))

    def extend(self, other: "BatchState") -> None:
        """Append ``other``'s rows (already prefilled into the cache rows ``B .. B + other.size - 1``)
        after this batch's rows; both must have the same capacity and both or neither keep features."""
        if other.capacity != self.capacity or (other.feats is None) != (self.feats is None):
            raise ValueError("extend: the two batches differ in capacity or features")
        self.requests += other.requests
        self.length += other.length
        self.draft_len += other.draft_len
        self.ids = torch.cat([self.ids, other.ids])
        if self.feats is not None:
            self.feats = torch.cat([self.feats, other.feats])
        self.length_dev = torch.cat([self.length_dev, other.length_dev])
        self.draft_len_dev = torch.cat([self.draft_len_dev, other.draft_len_dev])
        self.sampling = SamplingTensors.build([r.sampling for r in self.requests], self.ids.device)

    def _shrink(self) -> None:
        B = self.size
        self.ids, self.length_dev, self.draft_len_dev = self.ids[:B], self.length_dev[:B], self.draft_len_dev[:B]
        if self.feats is not None:
            self.feats = self.feats[:B]
        if self.sampling is not None:
            self.sampling.shrink(B)
