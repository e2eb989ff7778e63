"""The decoding loop: continuous batching on the speculative round, one step at a time.

Every caller drives this one loop: ``Generator.generate`` / ``stream`` add their prompts and step
until all are done, ``poss serve`` adds requests as they arrive, the tree timings
(:mod:`poss.decode.autotune`) step it with their own profile and no end tokens. Every
:meth:`DecodeEngine.step` is:

1. drop the rows that finished or were cancelled since the last step (``BatchState.drop_finished``:
   the last row moves into the hole, caches included);
2. admit waiting requests while the batch has room: the target prefill and the draft warm-up run on
   the new prompts only, written into the free cache rows ``B .. B+n-1`` (``StaticKVCache.rows``),
   and the new rows are appended to the live :class:`~poss.decode.batch.BatchState`; their first token
   comes from the prefill;
3. one speculative round (``Generator.round``) over every live row, then the stop rules, then the
   rows that finished leave.

Each sampled request draws its random numbers from its own ``torch.Generator`` (seeded by its
``seed``): its row of the round's uniforms comes from that generator alone, so a seeded request gives
the same tokens whether it runs alone or among others, and greedy rows are exactly what they are
alone (each row of every op depends only on that row).

While an engine has work, it owns the generator's caches: run one engine per generator at a time.
"""

import itertools
import random
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch

from poss.decode.batch import BatchState, Request, check_request
from poss.decode.params import SamplingParams, TreeParams
from poss.decode.stopping import Stopper
from poss.models.kv_cache import StaticKVCache


@dataclass
class Stats:
    """Per request: generated ``tokens`` (end token included), verify ``rounds``, ``tau`` = mean tokens
    per round (accepted draft tokens + 1), ``accept_hist[k]`` = rounds that accepted k draft tokens,
    ``seconds`` from its admission to its end, ``draft_tokens`` = tree nodes proposed past the root over
    all rounds (so ``1 + draft_tokens / rounds`` rows were verified per round)."""

    tokens: int
    rounds: int
    tau: float
    accept_hist: List[int]
    seconds: float
    finish_reason: str
    draft_tokens: int = 0


def request_stats(r: Request) -> Stats:
    """The :class:`Stats` of a request so far."""
    rounds = sum(r.accept_hist)
    tau = sum((k + 1) * c for k, c in enumerate(r.accept_hist)) / rounds if rounds else 0.0
    return Stats(len(r.generated), rounds, tau, list(r.accept_hist), r.seconds, r.finish_reason or "",
                 r.draft_tokens)


def check_speculate_max_batch(limit):
    """``limit`` if it is a valid speculation limit (an int >= 1, ``"auto"`` or None), else
    ``ValueError``."""
    if not (limit is None or limit == "auto"
            or (isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1)):
        raise ValueError(f"speculate_max_batch must be an int >= 1, 'auto' or None, got {limit!r}")
    return limit


def speculates(draft, tree: TreeParams) -> bool:
    """Whether rounds of ``tree`` draft at all (a draft, and a tree with nodes below the root)."""
    return draft is not None and tree.depth >= 1 and tree.num_nodes > 1


def round_slack(tree: TreeParams, depth: int) -> int:
    """Cache slots past a request's text that one round can touch: its tree (with the lookup chain),
    the draft's beam and its catch-up over the pairs the last round committed."""
    return tree.num_nodes + tree.beam_width * depth + depth + 2 * tree.lookup + 8


@dataclass
class StepEvent:
    """What one step did to one request: ``tokens`` newly generated (maybe none), and once, at its end,
    ``finished`` with ``finish_reason`` (``eos`` / ``length`` / ``context`` / ``stop`` / ``cancelled``)
    and its :class:`Stats`."""

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


def request_rng(sampling: SamplingParams, device) -> Optional[torch.Generator]:
    """The generator a request samples from: seeded by its ``seed`` (a fresh random seed when it has
    none); None for a greedy request, which draws nothing."""
    if sampling.greedy:
        return None
    seed = sampling.seed if sampling.seed is not None else random.randrange(1 << 62)
    return torch.Generator(device=device).manual_seed(seed)


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
        max_batch: most requests decoded together (None: no bound); more wait in :attr:`pending`.
        speculate_max_batch: speculate only while at most this many requests are live; larger batches
            take plain decoding rounds (one token each, no draft), since a tree round's cost grows with
            batch x tree rows. ``"auto"``: the generator's choice for this tree and ``max_batch``
            (:meth:`~poss.decode.generator.Generator.speculation_limit`); None: always speculate.
            Greedy output is the same either way; a seeded sampled request then gives the same tokens
            only under the same load (its uniforms are drawn per round, and the round type depends on
            the batch). So do lookup chains, which a batch pads to a common length.
        end_ids: the tokens that end a request (None: the generator's; the tree timings pass none, so
            every request runs its full length).
        profile: ``{phase: [seconds per round]}`` the rounds append to (``draft``, ``verify``,
            ``commit``, ``host``); None: the generator's ``profile`` attribute (None there too: no
            timing).
    """

    def __init__(self, generator, tree: Union[TreeParams, str, None] = None, max_batch: Optional[int] = None,
                 speculate_max_batch: Union[int, str, None] = None, end_ids: Optional[Iterable[int]] = None,
                 profile: Optional[Dict[str, List[float]]] = None):
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        check_speculate_max_batch(speculate_max_batch)
        self.gen = generator
        self.tree = generator.resolve_tree(tree)
        self.max_batch = max_batch
        self.speculate = speculates(generator.draft, self.tree)
        if speculate_max_batch == "auto":
            speculate_max_batch = generator.speculation_limit(self.tree, max_batch)
        self.speculate_max_batch = speculate_max_batch if self.speculate else None
        self.depth = self.tree.depth if self.speculate else 0
        self.slack = round_slack(self.tree, self.depth)
        self.end_ids = set(generator.end_ids if end_ids is None else end_ids)
        self.profile = profile
        # Target features feed the draft; a generator that keeps them for training needs them too.
        self.with_feats = self.speculate or generator.keep_features
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
        check_request(prompt, max_new_tokens, self.gen.runner.embed.shape[0], self.gen.context_limit)
        rid = next(self._next_id)
        while rid in self._live:  # an id a submitted request took
            rid = next(self._next_id)
        return self.submit(Request(rid, prompt, int(max_new_tokens), sampling or SamplingParams()), stop)

    def submit(self, request: Request, stop: Sequence[str] = ()) -> int:
        """Queue a checked :class:`Request` (``poss.decode.batch.check_request``) under its ``index`` as
        id, which no live request of this engine may hold. The engine fills in its tokens and
        statistics as it runs. Returns the id."""
        if request.index in self._live:
            raise ValueError(f"request id {request.index} is already in use")
        request.accept_hist = [0] * (self.depth + self.tree.lookup + 1)
        decode = self.gen.decode if self.gen.tokenizer is not None else None
        self._live[request.index] = _Live(Stopper(self.end_ids, stop, decode),
                                          request_rng(request.sampling, self.gen.runner.device))
        self._pending.append(request)
        return request.index

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
            profile = self.profile if self.profile is not None else self.gen.profile
            rows = self.gen.round(batch, t.num_nodes if spec else 1, self.depth if spec else 0, t.beam_width,
                                  self._uniforms(batch.requests), lookup=t.lookup if spec or not self.speculate else 0,
                                  profile=profile)
            since = time.perf_counter()
            before = [len(r.generated) for r in batch.requests]
            self.gen.apply_round(batch, rows, lambda r: self._live[r.index].stopper)
            events += [self._event(r, n) for r, n in zip(batch.requests, before)]
            self._drop()
            record_phase(profile, "host", since, batch.ids.device)
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
        sub = BatchState(new, runner.feature_width, self.capacity, runner.dtype, runner.device, self.with_feats)
        cache, draft_caches = runner.cache, draft.caches if self.speculate else None
        runner.cache = cache.rows(B)  # the prefill and warm-up write rows B .. B+n-1
        if self.speculate:
            draft.caches = draft_caches.rows(B)
        try:
            first = self.gen.prefill(sub, self.depth, self._uniforms(new))
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
        gone = [r for r in batch.requests if r.finished]
        if not gone:
            return
        if self.gen.keep_features:
            for b, r in enumerate(batch.requests):
                if r.finished and r.features is None:
                    n = len(r.prompt) + len(r.generated) - 1  # features exist for t < committed length
                    r.features = batch.feats[b, :n].clone()
        caches = [self.gen.runner.cache] + ([self.gen.draft.caches] if self.speculate else [])
        batch.drop_finished(caches)
        for r in gone:
            self._live.pop(r.index, None)

    # -- helpers ---------------------------------------------------------------------------------
    def _uniforms(self, requests: List[Request]) -> Callable[[int, int], torch.Tensor]:
        """``uniforms(B, N)`` for ``Generator.prefill`` / ``round``: ``[B, N + 1] float32``, row b from
        request b's own generator (zeros for greedy rows, which read none)."""

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


def record_phase(profile: Optional[Dict[str, List[float]]], phase: str, since: float, device) -> float:
    """Append the seconds since ``since`` to ``profile[phase]`` (nothing when ``profile`` is None);
    returns now. On CUDA it first waits for the device, so the phase's device work counts."""
    if profile is None:
        return since
    if device.type == "cuda":
        torch.cuda.synchronize()
    now = time.perf_counter()
    profile.setdefault(phase, []).append(now - since)
    return now
