"""Continuous batching on the speculative loop: a step-wise decoding core.

:class:`DecodeEngine` owns a :class:`~poss.decode.generator.Generator`'s caches and decodes a changing
set of requests. Every :meth:`DecodeEngine.step` is:

1. drop the rows that finished or were cancelled since the last step (``BatchState.drop_finished``:
   the last row moves into the hole, caches included);
2. admit waiting requests while the batch has room: the target prefill and the draft warm-up run on
   the new prompts only, written into the free cache rows ``B .. B+n-1`` (row views of the caches),
   and the new rows are appended to the live :class:`~poss.decode.batch.BatchState`; their first token
   comes from the prefill;
3. one speculative round (``Generator.round``) over every live row, then the stop rules.

It reuses the generator's prefill, round, stop rules and batch bookkeeping; only admission is new.
Each request samples with its own ``torch.Generator`` (seeded by its ``seed``): its row of the round's
uniforms comes from that generator alone, so a seeded request gives the same tokens whether it runs
alone or among others, and greedy rows are exactly what ``Generator.generate`` gives (each row of
every op depends only on that row).

While an engine has work, it owns the generator's caches: do not call ``generate`` / ``stream`` on the
same generator in between (they resize and overwrite the caches).
"""

import itertools
import random
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

import torch

from poss.decode.batch import BatchState, Request
from poss.decode.generator import Stats, check_speculate_max_batch, request_stats
from poss.decode.params import SamplingParams, TreeParams
from poss.decode.stopping import Stopper
from poss.models.kv_cache import StaticKVCache


@dataclass
class StepEvent:
    """What one step did to one request: ``tokens`` newly generated (maybe none), and once, at its end,
    ``finished`` with ``finish_reason`` (``eos`` / ``length`` / ``context`` / ``stop`` / ``cancelled``)
    and its :class:`~poss.decode.generator.Stats`."""

    id: int
    tokens: List[int]
    finished: bool = False
    finish_reason: Optional[str] = None
    stats: Optional[Stats] = None


class _Live:
    """Per-request host state beside its :class:`Request`: stop rules, sampling RNG, start time."""

    __slots__ = ("stopper", "rng", "start")

    def __init__(self, stopper: Stopper, rng: Optional[torch.Generator]):
        self.stopper, self.rng, self.start = stopper, rng, time.perf_counter()


def _rows_from(cache: StaticKVCache, offset: int) -> StaticKVCache:
    """A cache whose row 0 is ``cache``'s row ``offset`` (a view: writes land in ``cache``)."""
    view = object.__new__(StaticKVCache)
    view.k, view.v = cache.k[:, offset:], cache.v[:, offset:]
    return view


def _grown_keeping(cache: StaticKVCache, rows: int, max_seq: int, keep_rows: int) -> StaticKVCache:
    """``cache`` when it is big enough, else a larger one holding its first ``keep_rows`` rows."""
    new = cache.grown(rows, max_seq)
    if new is not cache and keep_rows:
        S = cache.max_seq
        new.k[:, :keep_rows, :, :S] = cache.k[:, :keep_rows]
        new.v[:, :keep_rows, :, :S] = cache.v[:, :keep_rows]
    return new


class DecodeEngine:
    """Step-wise continuous batching on ``generator`` (see the module docstring).

    Args:
        generator: the :class:`~poss.decode.generator.Generator` (its runner, draft, tokenizer, end
            tokens and context limit).
        tree: the draft tree of every round: a :class:`TreeParams`, ``"auto"``, or None for the
            generator's ``default_tree``.
        max_batch: most requests decoded together (None: no bound); more wait in :meth:`pending`.
        speculate_max_batch: speculate only while at most this many requests are live; larger batches
            take plain decoding rounds (one token each, no draft), since a tree round's cost grows with
            batch x tree rows. ``"auto"``: measured once on this machine
            (:func:`poss.decode.autotune.speculation_limit`); None: always speculate. Greedy output is
            the same either way; a seeded sampled request then gives the same tokens only under the
            same load (its uniforms are drawn per round, and the round type depends on the batch).
    """

    def __init__(self, generator, tree: Union[TreeParams, str, None] = None, max_batch: Optional[int] = None,
                 speculate_max_batch: Union[int, str, None] = None):
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        check_speculate_max_batch(speculate_max_batch)
        self.gen = generator
        self.tree = generator.resolve_tree(tree)
        self.max_batch = max_batch
        t = self.tree
        self.speculate = generator.draft is not None and t.depth >= 1 and t.num_nodes > 1
        if speculate_max_batch == "auto":
            from poss.decode.autotune import speculation_limit

            speculate_max_batch = speculation_limit(generator, t, max_batch) if self.speculate else None
        self.speculate_max_batch = speculate_max_batch
        self.depth = t.depth if self.speculate else 0
        # Slots past a request's text that one round can touch: its tree and the draft's catch-up.
        self.slack = t.num_nodes + t.beam_width * self.depth + self.depth + 2 * t.lookup + 8
        self.capacity = 0  # slots per row of the batch buffers and caches
        self.batch: Optional[BatchState] = None
        self._pending: List[Request] = []
        self._live: Dict[int, _Live] = {}
        self._out: List[StepEvent] = []  # events produced outside step (cancelled while waiting)
        self._next_id = itertools.count()

    # -- requests --------------------------------------------------------------------------------
    def add(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: Optional[SamplingParams] = None,
            stop: Sequence[str] = ()) -> int:
        """Queue a request (token ids); it joins the batch at a later :meth:`step`. Returns its id."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt is empty: there is no token to continue from")
        if len(prompt) >= self.gen.context_limit:
            raise ValueError(f"the prompt has {len(prompt)} tokens, at or over the context limit of "
                             f"{self.gen.context_limit}: no room to generate")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        sampling = sampling or SamplingParams()
        rid = next(self._next_id)
        req = Request(rid, prompt, int(max_new_tokens), sampling)
        req.accept_hist = [0] * (self.depth + self.tree.lookup + 1)
        rng = None
        if not sampling.greedy:
            seed = sampling.seed if sampling.seed is not None else random.randrange(1 << 62)
            rng = torch.Generator(device=self.gen.runner.device).manual_seed(seed)
        decode = self.gen.decode if self.gen.tokenizer is not None else None
        self._live[rid] = _Live(Stopper(self.gen.end_ids, stop, decode), rng)
        self._pending.append(req)
        return rid

    def cancel(self, rid: int) -> bool:
        """Stop a request: a waiting one leaves now, a running one's row is dropped at the next step.
        Its final event (``cancelled``) comes from the next step. False when it is unknown or over."""
        for i, r in enumerate(self._pending):
            if r.index == rid:
                del self._pending[i]
                r.finished, r.finish_reason = True, "cancelled"
                self._out.append(self._event(r, 0))
                del self._live[rid]
                return True
        for r in self.batch.requests if self.batch is not None else ():
            if r.index == rid and not r.finished:
                r.finished, r.finish_reason = True, "cancelled"
                self._out.append(self._event(r, len(r.generated)))
                return True
        return False

    @property
    def active(self) -> int:
        """Requests in the running batch (a cancelled one counts until the next step drops it)."""
        return self.batch.size if self.batch is not None else 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def has_work(self) -> bool:
        return bool(self._pending or self._out or self.active)

    def reset(self) -> None:
        """Forget every request (after an error, or at shutdown)."""
        self.batch, self.gen.state = None, None
        self._pending, self._out, self._live = [], [], {}

    # -- the step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> List[StepEvent]:
        """Drop finished rows, admit waiting requests, run one round: the events, in order."""
        events, self._out = self._out, []
        self._drop()
        self._admit(events)
        batch = self.batch
        if batch is not None and batch.size:
            t = self.tree
            # A plain round leaves the draft behind; its next round catches up on the pairs it missed.
            spec = self.speculate and (self.speculate_max_batch is None or batch.size <= self.speculate_max_batch)
            rows = self.gen.round(batch, t.num_nodes if spec else 1, self.depth if spec else 0, t.beam_width,
                                  uniforms=self._uniforms(batch.requests),
                                  lookup=t.lookup if spec or not self.speculate else 0)
            before = [len(r.generated) for r in batch.requests]
            self.gen.apply_round(batch, rows, lambda r: self._live[r.index].stopper)
            events += [self._event(r, n) for r, n in zip(batch.requests, before)]
            self._drop()
        return events

    def _admit(self, events: List[StepEvent]) -> None:
        B = self.active
        room = len(self._pending) if self.max_batch is None else max(self.max_batch - B, 0)
        new, self._pending = self._pending[:room], self._pending[room:]
        for r in [r for r in new if r.max_new_tokens == 0]:
            r.finished, r.finish_reason = True, "length"
            events.append(self._event(r, 0))
            del self._live[r.index]
        new = [r for r in new if r.max_new_tokens > 0]
        if not new:
            return
        limit = self.gen.context_limit
        self._ensure(B + len(new), max(min(limit, len(r.prompt) + r.max_new_tokens) + self.slack for r in new))
        runner, draft = self.gen.runner, self.gen.draft
        sub = BatchState(new, runner.hidden_size, self.capacity, runner.dtype, runner.device, self.speculate)
        cache, draft_caches = runner.cache, draft.caches if self.speculate else None
        runner.cache = _rows_from(cache, B)  # the prefill and warm-up write rows B .. B+n-1
        if self.speculate:
            draft.caches = _rows_from(draft_caches, B)
        try:
            first = self.gen.prefill(sub, self.depth, uniforms=self._uniforms(new))
        finally:
            runner.cache = cache
            if self.speculate:
                draft.caches = draft_caches
        for b, r in enumerate(new):
            self._live[r.index].stopper.append(r, [first[b]], limit - len(r.prompt))
            events.append(self._event(r, 0))
        if self.batch is None or self.batch.size == 0:
            self.batch = sub
        else:
            self.batch.extend(sub)
        self.gen.state = self.batch  # the live batch, for inspection
        self._drop()  # requests that ended at their first token

    def _ensure(self, rows: int, capacity: int) -> None:
        """Caches and batch buffers for ``rows`` rows of at least ``capacity`` slots, live rows kept."""
        self.capacity = max(self.capacity, capacity)
        rows = max(rows, self.max_batch or 0)
        B = self.active
        runner = self.gen.runner
        runner.cache = _grown_keeping(runner.cache, rows, self.capacity, B)
        if self.speculate:
            draft = self.gen.draft
            if draft.caches is None:
                draft.ensure_caches(rows, self.capacity)
            else:
                draft.caches = _grown_keeping(draft.caches, rows, self.capacity, B)
        if self.batch is not None:
            self.batch.grow_capacity(self.capacity)

    def _drop(self) -> None:
        batch = self.batch
        if batch is None:
            return
        gone = [r.index for r in batch.requests if r.finished]
        if not gone:
            return
        caches = [self.gen.runner.cache] + ([self.gen.draft.caches] if self.speculate else [])
        batch.drop_finished(caches)
        for rid in gone:
            self._live.pop(rid, None)

    # -- helpers ---------------------------------------------------------------------------------
    def _uniforms(self, requests: List[Request]):
        """``uniforms(B, N)`` for ``Generator.prefill`` / ``round``: row b from request b's own
        generator (zeros for greedy rows, which read none)."""

        def draw(B: int, N: int) -> torch.Tensor:
            dev = self.gen.runner.device
            out = torch.zeros(B, N + 1, device=dev)
            for b, r in enumerate(requests):
                rng = self._live[r.index].rng
                if rng is not None:
                    out[b] = torch.rand(N + 1, generator=rng, device=dev)
            return out

        return draw

    def _event(self, r: Request, before: int) -> StepEvent:
        tokens = list(r.generated[before:])
        if not r.finished:
            return StepEvent(r.index, tokens)
        live = self._live.get(r.index)
        if not r.seconds and live is not None:
            r.seconds = time.perf_counter() - live.start
        return StepEvent(r.index, tokens, True, r.finish_reason, request_stats(r))
