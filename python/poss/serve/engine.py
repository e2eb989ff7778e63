"""The engine: one worker thread owns the :class:`~poss.serve.backend.Backend`; asyncio handlers talk to it
through a bounded waiting queue (in) and one event queue per request (out).

The worker loop, between two backend steps: apply cancellations, move waiting requests into the
backend while it has free slots, then ``step()`` and hand the events to the event loop
(``call_soon_threadsafe``). Decoding never runs on the event loop, so ``/health`` and ``/metrics``
answer while a batch decodes. Every backend method is called from the worker thread only (and from
:meth:`Engine.start` before the worker exists). A request the backend fails to add or cancel ends with
an ``error`` event; an unexpected worker failure ends every open request and stops the engine.
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
        # The backend's free slots as the worker last saw them: submit cannot ask the backend, which may
        # be inside step() on the worker thread.
        self._free = 0  # guarded by _cond
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
        self._free = self.backend.free_slots()  # the worker does not run yet: submit may come first
        self._thread = threading.Thread(target=self._work, name="poss-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the worker (after its current step) and end every open request with an error."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_open("the server is shutting down")

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- requests (event-loop thread) ------------------------------------------------------------
    def submit(self, request: GenRequest) -> Handle:
        """Queue a request; raises :class:`QueueFull` or :class:`EngineStopped`.

        Up to ``max_queue`` requests may wait beyond the backend's free slots; those that fit a free
        slot go in at the worker's next turn (after its current step).
        """
        if not self.running:
            raise EngineStopped("the engine is not running")
        with self._cond:
            if len(self._waiting) - self._free >= self.max_queue:
                raise QueueFull(f"the server queue is full ({self.max_queue} requests waiting beyond the batch)")
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
                    self._free = b.free_slots()  # the last step may have freed some
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
                        try:
                            b.add(req)
                        except Exception as exc:  # fail this request only: the others must not hang
                            log.exception("backend add failed for request %s", rid)
                            early.append(_failed(rid, exc))
                        else:
                            self._admitted.add(rid)
                    self._free = b.free_slots()
                    self.metrics.queue_depth.set(len(self._waiting))
                for rid in cancels:
                    if rid in self._admitted:
                        try:
                            b.cancel(rid)
                        except Exception as exc:  # its client is gone; an error event still closes the handle
                            log.exception("backend cancel failed for request %s", rid)
                            early.append(_failed(rid, exc))
                try:
                    events = early + b.step()
                except Exception as exc:  # a backend bug: fail what it holds, keep serving
                    log.exception("backend step failed")
                    events = early + [_failed(rid, exc) for rid in self._admitted]
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
        except Exception as exc:  # a bug outside add/cancel/step: never leave a request waiting forever
            log.exception("the engine worker failed; stopping the engine")
            with self._cond:
                self._stopping = True  # submit refuses from now on, before the loop fails what is open
            self._call_on_loop(self._fail_open, f"the engine failed ({type(exc).__name__}: {exc})")
        finally:
            b.close()
            self._active = 0
            self.metrics.active_batch.set(0)

    def _deliver(self, events: List[Event]) -> None:
        self._call_on_loop(self._dispatch, events)

    def _call_on_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # -- back on the event loop ------------------------------------------------------------------
    def _fail_open(self, error: str) -> None:
        """End every open request with an ``error`` event carrying ``error``."""
        self._dispatch([Event(rid, finish_reason="error", error=error) for rid in list(self._handles)])

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


def _failed(request_id: str, exc: BaseException) -> Event:
    """The final event of a request the backend raised ``exc`` for."""
    return Event(request_id, finish_reason="error", error=f"{type(exc).__name__}: {exc}")
