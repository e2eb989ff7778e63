"""The step-wise batch interface between the server and the decoding loop.

:class:`Backend` is what the engine drives; nothing else in :mod:`poss.serve` knows the loop. The
engine calls every method of a backend from ONE worker thread, so a backend needs no locking:

- ``add(request)`` hands over a request when ``free_slots() > 0``;
- ``step()`` advances the work by one unit (at most about one verify round) and returns the
  per-request :class:`Event` s it produced: new text, and once per request a final event with its
  ``finish_reason`` and :class:`RequestStats`;
- ``cancel(request_id)`` drops a request; its final event (``finish_reason="cancelled"``) comes from
  the next ``step()``.

Phase 1 (:class:`GeneratorBackend`) runs on the public ``Generator.stream`` API: it starts a batch
of up to ``max_batch`` added requests, streams it to the end, and only then takes the next batch.
Requests added while a batch runs wait for it (``free_slots()`` is 0 meanwhile); a request's final
event comes when its whole batch ends; a cancelled request is only stopped when every request of
its batch is cancelled (otherwise its row keeps computing and its output is discarded). Phase 2
replaces it with a backend that admits requests into the running batch between rounds and drops
cancelled rows at the next round, behind the same interface.

This module is the only place that depends on the ``Generator`` API (``stream``, ``encode``,
``tokenizer``, ``context_limit``, ``last_result``).
"""

import abc
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Set, Tuple

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
    seconds: float  # from its batch's start to its end


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

    def close(self) -> None:
        """Stop any running batch (shutdown)."""


class GeneratorBackend(Backend):
    """Phase 1: whole batches on ``Generator.stream`` (see the module docstring for the limits).

    A batch holds requests with the same ``max_tokens``, stop strings and seed, which the stream API
    takes once per call. Greedy requests ignore the seed; a sampled request with a seed runs in a
    batch of its own, so that its output depends only on the seed.
    """

    def __init__(self, generator, max_batch: int = 8, tree=None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.gen = generator
        self.max_batch = max_batch
        self.context_limit = int(generator.context_limit)
        tok = generator.tokenizer
        self.vocab_size = len(tok) if tok is not None else None  # prompt token ids must be below it
        self.tree = tree  # a TreeParams, or None for the generator's default tree
        self.speculative = getattr(generator, "draft", None) is not None
        self._pending: List[GenRequest] = []
        self._batch: List[GenRequest] = []  # the running batch, in stream index order
        self._iter: Optional[Iterator] = None
        self._shown: List[str] = []  # text streamed so far, per batch index
        self._cancelled: Set[str] = set()
        self._out: List[Event] = []  # events produced outside step (cancellations)

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
        return 0 if self._iter is not None else self.max_batch - len(self._pending)

    def add(self, request: GenRequest) -> None:
        self._pending.append(request)

    def cancel(self, request_id: str) -> None:
        for i, r in enumerate(self._pending):
            if r.id == request_id:
                del self._pending[i]
                self._out.append(Event(request_id, finish_reason="cancelled"))
                return
        if any(r.id == request_id for r in self._batch) and request_id not in self._cancelled:
            self._cancelled.add(request_id)
            self._out.append(Event(request_id, finish_reason="cancelled"))
            if all(r.id in self._cancelled for r in self._batch):
                self._end_batch()  # nobody listens: stop computing

    def active(self) -> int:
        return len(self._batch) - len(self._cancelled)

    def pending(self) -> int:
        return len(self._pending)

    def step(self) -> List[Event]:
        events, self._out = self._out, []
        if self._iter is None:
            if not self._pending:
                return events
            self._start_batch()
        try:
            index, piece = next(self._iter)
        except StopIteration:
            events += self._final_events()
            self._end_batch()
            return events
        except Exception as exc:  # a failed batch fails its requests, not the server
            events += [Event(r.id, finish_reason="error", error=f"{type(exc).__name__}: {exc}")
                       for r in self._batch if r.id not in self._cancelled]
            self._end_batch()
            return events
        self._shown[index] += piece
        rid = self._batch[index].id
        if rid not in self._cancelled:
            events.append(Event(rid, text=piece))
        return events

    def close(self) -> None:
        self._end_batch()
        self._pending.clear()

    # -- phase-1 batching ------------------------------------------------------------------------
    @staticmethod
    def _key(r: GenRequest):
        seed = None if r.temperature <= 0 or r.seed is None else ("solo", r.id)
        return r.max_tokens, tuple(r.stop), seed

    def _start_batch(self) -> None:
        key = self._key(self._pending[0])
        batch = [r for r in self._pending if self._key(r) == key][: self.max_batch]
        taken = {r.id for r in batch}
        self._pending = [r for r in self._pending if r.id not in taken]
        first = batch[0]
        seed = first.seed if key[2] is not None else None
        self._batch, self._shown, self._cancelled = batch, [""] * len(batch), set()
        self._iter = self.gen.stream(
            [r.prompt for r in batch], max_new_tokens=first.max_tokens,
            temperature=[r.temperature for r in batch], top_k=[r.top_k for r in batch],
            top_p=[r.top_p for r in batch], seed=seed, stop=list(first.stop), tree=self.tree)

    def _final_events(self) -> List[Event]:
        result = self.gen.last_result
        events = []
        for i, r in enumerate(self._batch):
            if r.id in self._cancelled:
                continue
            text, s = result.texts[i], result.stats[i]
            rest = text[len(self._shown[i]):] if text.startswith(self._shown[i]) else ""
            stats = RequestStats(len(r.prompt), s.tokens, s.rounds, s.tau, list(s.accept_hist), s.seconds)
            events.append(Event(r.id, text=rest, finish_reason=FINISH.get(s.finish_reason, "stop"), stats=stats))
        return events

    def _end_batch(self) -> None:
        if self._iter is not None:
            close = getattr(self._iter, "close", None)
            if close is not None:
                close()
        self._iter, self._batch, self._shown, self._cancelled = None, [], [], set()

