"""The step-wise batch interface between the server and the decoding loop.

:class:`Backend` is what the engine drives; nothing else in :mod:`poss.serve` knows the loop. The
engine calls every method of a backend from ONE worker thread, so a backend needs no locking:

- ``add(request)`` hands over a request when ``free_slots() > 0``;
- ``step()`` advances the work by one unit (at most about one verify round) and returns the
  per-request :class:`Event` s it produced: new text, and once per request a final event with its
  ``finish_reason`` and :class:`RequestStats`;
- ``cancel(request_id)`` drops a request; its final event (``finish_reason="cancelled"``) comes from
  the next ``step()``.

:class:`ContinuousBackend` is continuous batching on :class:`poss.decode.engine.DecodeEngine`: a
request added while others decode joins the running batch at the next step (its prompt is prefilled
into a free cache row, then it takes part in the next verify round), a finished or cancelled row
leaves the batch at the next round, and each request keeps its own sampling parameters, seed and
stop strings. ``step()`` is one verify round (plus the prefill of the requests that joined).

This module is the only place that depends on the decoding API (``DecodeEngine``, ``Generator.encode``,
``tokenizer``, ``decode``, ``context_limit``).
"""

import abc
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


@dataclass
class GenRequest:
    """One validated request, already tokenized. ``stop``: stop strings (the text is cut before them)."""

    id: str
    prompt: List[int]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: Tuple[str, ...] = ()


@dataclass
class RequestStats:
    prompt_tokens: int
    completion_tokens: int  # generated tokens, the end token included
    rounds: int  # verify rounds the request took part in
    tau: float  # mean tokens per round
    accept_hist: List[int]  # accept_hist[k]: rounds that accepted k draft tokens
    seconds: float  # from its admission into the backend to its end


@dataclass
class Event:
    """Something that happened to one request: ``text`` to append, and/or its end.

    ``finish_reason`` is None while the request runs, then one of ``stop``, ``length``,
    ``cancelled``, ``error`` (with ``error`` the message). ``stats`` comes with ``stop`` / ``length``.
    """

    id: str
    text: str = ""
    finish_reason: Optional[str] = None
    stats: Optional[RequestStats] = None
    error: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Backend(abc.ABC):
    """A model that decodes a changing set of requests, one step at a time (single-threaded use)."""

    max_batch: int
    context_limit: int  # longest sequence, prompt + generated
    vocab_size: Optional[int] = None  # when set, prompt token ids must be below it

    @abc.abstractmethod
    def encode_chat(self, messages: List[dict]) -> List[int]:
        """Token ids of a chat (the model's chat template, generation prompt added)."""

    @abc.abstractmethod
    def encode_text(self, text: str) -> List[int]:
        """Token ids of a raw completion prompt (no template)."""

    @abc.abstractmethod
    def free_slots(self) -> int:
        """How many more requests :meth:`add` takes now."""

    @abc.abstractmethod
    def add(self, request: GenRequest) -> None:
        """Take ``request``; it starts at a later :meth:`step`."""

    @abc.abstractmethod
    def cancel(self, request_id: str) -> None:
        """Drop a request (unknown or finished ids are ignored); its final event comes from the next step."""

    @abc.abstractmethod
    def step(self) -> List[Event]:
        """Advance by one unit of work (blocking); the events it produced, in order."""

    @abc.abstractmethod
    def active(self) -> int:
        """Requests in the running batch."""

    @abc.abstractmethod
    def pending(self) -> int:
        """Requests added but not running yet."""

    def has_work(self) -> bool:
        return self.active() > 0 or self.pending() > 0

    def close(self) -> None:  # noqa: B027  (optional hook: most backends hold nothing to release)
        """Stop any running batch (shutdown)."""


class ContinuousBackend(Backend):
    """Continuous batching on :class:`~poss.decode.engine.DecodeEngine` (see the module docstring).

    Args:
        generator: the loaded :class:`~poss.decode.generator.Generator` (the backend owns its caches).
        max_batch: requests decoded together.
        tree: a :class:`~poss.decode.params.TreeParams`, or None for the default tree.
        speculate_max_batch: speculate only while at most this many requests are live (an int,
            ``"auto"`` or None: see :class:`~poss.decode.engine.DecodeEngine`).
    """

    def __init__(self, generator, max_batch: int = 8, tree=None, speculate_max_batch=None):
        from poss.decode.engine import DecodeEngine

        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.gen = generator
        self.max_batch = max_batch
        self.context_limit = int(generator.context_limit)
        tok = generator.tokenizer
        self.vocab_size = len(tok) if tok is not None else None  # prompt token ids must be below it
        self.engine = DecodeEngine(generator, tree, max_batch=max_batch, speculate_max_batch=speculate_max_batch)
        self.speculative = self.engine.speculate
        self._reqs: Dict[int, _Running] = {}  # engine id -> request, until its final event
        self._ids: Dict[str, int] = {}  # request id -> engine id
        self._out: List[Event] = []  # events produced outside step (requests the engine refused)

    # -- prompts ---------------------------------------------------------------------------------
    def encode_chat(self, messages: List[dict]) -> List[int]:
        return self.gen.encode(list(messages))

    def encode_text(self, text: str) -> List[int]:
        tok = self.gen.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer: send the prompt as token ids")
        return list(tok(text).input_ids)

    # -- the interface ---------------------------------------------------------------------------
    def free_slots(self) -> int:
        return max(self.max_batch - self.engine.active - self.engine.pending, 0)

    def add(self, request: GenRequest) -> None:
        from poss.decode.params import SamplingParams

        try:
            sampling = SamplingParams(temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
                                      seed=request.seed)
            eid = self.engine.add(request.prompt, request.max_tokens, sampling, stop=request.stop)
        except ValueError as exc:  # the app validates first; never let one request stop the worker
            self._out.append(Event(request.id, finish_reason="error", error=str(exc)))
            return
        self._reqs[eid] = _Running(request)
        self._ids[request.id] = eid

    def cancel(self, request_id: str) -> None:
        eid = self._ids.get(request_id)
        if eid is not None:
            self.engine.cancel(eid)

    def active(self) -> int:
        return self.engine.active

    def pending(self) -> int:
        return self.engine.pending

    def has_work(self) -> bool:
        return bool(self._out) or self.engine.has_work()

    def step(self) -> List[Event]:
        events, self._out = self._out, []
        try:
            steps = self.engine.step()
        except Exception as exc:  # a failed round fails the requests it held, not the server
            error = f"{type(exc).__name__}: {exc}"
            events += [Event(run.request.id, finish_reason="error", error=error) for run in self._reqs.values()]
            self.close()
            return events
        for ev in steps:
            run = self._reqs.get(ev.id)
            if run is None:
                continue
            r = run.request
            if ev.finish_reason == "cancelled":
                events.append(Event(r.id, finish_reason="cancelled"))
            else:
                run.tokens += ev.tokens
                piece = run.advance(self.gen, ev)
                if ev.finished:
                    s = ev.stats
                    stats = RequestStats(len(r.prompt), s.tokens, s.rounds, s.tau, list(s.accept_hist), s.seconds)
                    events.append(Event(r.id, text=piece, finish_reason=FINISH.get(ev.finish_reason, "stop"),
                                        stats=stats))
                elif piece:
                    events.append(Event(r.id, text=piece))
            if ev.finished:
                del self._reqs[ev.id]
                self._ids.pop(r.id, None)
        return events

    def close(self) -> None:
        self.engine.reset()
        self._out.clear()
        self._reqs.clear()
        self._ids.clear()


class _Running:
    """A request's tokens so far and the text already streamed."""

    __slots__ = ("request", "tokens", "shown")

    def __init__(self, request: GenRequest):
        self.request, self.tokens, self.shown = request, [], 0

    def advance(self, gen, ev) -> str:
        """The text to stream now: what the stop strings and incomplete characters allow."""
        from poss.decode.stopping import first_stop, safe_text

        text = gen.decode(self.tokens)
        if ev.finish_reason == "stop":  # cut right before the stop string
            cut = first_stop(text, self.request.stop)
            if cut is not None:
                text = text[:cut]
        visible = safe_text(text, self.request.stop, ev.finished)
        if len(visible) <= self.shown:
            return ""
        piece, self.shown = visible[self.shown:], len(visible)
        return piece
