"""The engine: one worker thread owns the :class:`~poss.serve.backend.Backend`; asyncio handlers talk to it
through a bounded waiting queue (in) and one event queue per request (out).

The worker loop, between two backend steps: apply cancellations, move waiting requests into the
backend while it has free slots, then ``step()`` and hand the events to the event loop
(``call_soon_threadsafe``). Decoding never runs on the event loop, so ``/health`` and ``/metrics``
answer while a batch decodes. Every backend method is called from the worker thread only.
"""

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from typing import AsyncIterator, Dict, List, Optional

from poss.serve.backend import Backend, Event, GenRequest
from poss.serve.metrics import Metrics

log = logging.getLogger("poss.serve")


class QueueFull(Exception):
    """The waiting queue is at its bound."""


class EngineStopped(Exception):
    """The engine is not running (not started yet, or shutting down)."""


class Handle:
    """One submitted request: its events arrive on ``queue``; iterate with :meth:`events`."""

    def __init__(self, request: GenRequest):
        self.request = request
        self.queue: "asyncio.Queue[Event]" = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.first_text: Optional[float] = None
        self.finished = False

    async def events(self) -> AsyncIterator[Event]:
        while True:
            ev = await self.queue.get()
            yield ev
            if ev.finished:
                return


class Engine:
    def __init__(self, backend: Backend, max_queue: int = 64, metrics: Optional[Metrics] = None):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.backend, self.max_queue = backend, max_queue
        self.metrics = metrics or Metrics()
        self._cond = threading.Condition()
        self._waiting: "OrderedDict[str, GenRequest]" = OrderedDict()  # guarded by _cond
        self._cancels: List[str] = []  # guarded by _cond
        self._stopping = False
        self._admitted: set = set()  # ids inside the backend (worker thread only)
        self._handles: Dict[str, Handle] = {}  # event-loop thread only
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._active = 0

    # -- lifecycle (event-loop thread) -----------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="poss-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the worker (after its current step) and end every open request with an error."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        for rid in list(self._handles):
            self._dispatch([Event(rid, finish_reason="error", error="the server is shutting down")])

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- requests (event-loop thread) ------------------------------------------------------------
    def submit(self, request: GenRequest) -> Handle:
        """Queue a request; raises :class:`QueueFull` or :class:`EngineStopped`."""
        if not self.running:
            raise EngineStopped("the engine is not running")
        with self._cond:
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"the server queue is full ({self.max_queue} requests waiting)")
            handle = Handle(request)
            self._handles[request.id] = handle
            self._waiting[request.id] = request
            self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify_all()
        return handle

    def cancel(self, request_id: str) -> None:
        """Drop a request (a client went away); a no-op once it finished."""
        if request_id not in self._handles:
            return
        with self._cond:
            self._cancels.append(request_id)
            self._cond.notify_all()

    def queue_depth(self) -> int:
        return len(self._waiting)

    def active(self) -> int:
        return self._active

    def open_requests(self) -> int:
        """Submitted requests not finished yet (waiting, pending or decoding)."""
        return len(self._handles)

    # -- the worker thread -----------------------------------------------------------------------
    def _work(self) -> None:
        b = self.backend
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._cancels or (self._waiting and b.free_slots() > 0)
                               or b.has_work()):
                        self._cond.wait()
                    if self._stopping:
                        break
                    cancels, self._cancels = self._cancels, []
                    early = []
                    for rid in cancels:
                        if self._waiting.pop(rid, None) is not None:
                            early.append(Event(rid, finish_reason="cancelled"))
                    while self._waiting and b.free_slots() > 0:
                        rid, req = self._waiting.popitem(last=False)
                        b.add(req)
                        self._admitted.add(rid)
                    self.metrics.queue_depth.set(len(self._waiting))
                for rid in cancels:
                    if rid in self._admitted:
                        b.cancel(rid)
                try:
                    events = early + b.step()
                except Exception as exc:  # a backend bug: fail what it holds, keep serving
                    log.exception("backend step failed")
                    events = early + [Event(rid, finish_reason="error", error=f"{type(exc).__name__}: {exc}")
                                      for rid in self._admitted]
                    b.close()
                for ev in events:
                    if ev.finished:
                        self._admitted.discard(ev.id)
                self._active = b.active()
                self.metrics.active_batch.set(self._active)
                if self._active:
                    self.metrics.batch_size.observe(self._active)
                if events:
                    self._deliver(events)
        finally:
            b.close()
            self._active = 0
            self.metrics.active_batch.set(0)

    def _deliver(self, events: List[Event]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._dispatch, events)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # -- back on the event loop ------------------------------------------------------------------
    def _dispatch(self, events: List[Event]) -> None:
        m, now = self.metrics, time.perf_counter()
        for ev in events:
            h = self._handles.get(ev.id)
            if h is None:
                continue
            if ev.text and h.first_text is None:
                h.first_text = now
                m.ttft.observe(now - h.arrival)
            if ev.finished:
                del self._handles[ev.id]
                h.finished = True
                m.request_seconds.observe(now - h.arrival)
                s = ev.stats
                if s is not None:
                    m.prompt_tokens.inc(s.prompt_tokens)
                    m.generation_tokens.inc(s.completion_tokens)
                    if s.rounds:
                        m.tau.observe(s.tau)
                        m.round_seconds.observe(s.seconds / s.rounds)
            h.queue.put_nowait(ev)
