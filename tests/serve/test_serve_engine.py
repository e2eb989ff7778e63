"""The engine and the HTTP layer on a fake :class:`Backend` (no model): the queue bound (429) beyond the
free batch slots, cancelling waiting and running requests, a failing backend (step, add, cancel), and a
backend that admits requests between steps (the continuous-batching shape phase 2 plugs in) behind the
unchanged app."""

import asyncio
import logging
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from helpers.serve import free_port  # noqa: E402
from poss.serve.app import create_app  # noqa: E402
from poss.serve.backend import Backend, Event, GenRequest, RequestStats  # noqa: E402
from poss.serve.engine import Engine, QueueFull  # noqa: E402


class FakeBackend(Backend):
    """Continuous batching in miniature: every step emits one character per running request (the
    characters of its prompt ids, ``chr(i)``), admits up to ``max_batch`` requests at any step, and
    blocks while ``gate`` is clear."""

    def __init__(self, max_batch=2, fail_on=None):
        self.max_batch, self.context_limit, self.vocab_size = max_batch, 64, None
        self.running, self.waiting, self.out = {}, [], []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_on = fail_on
        self.steps = 0

    def encode_chat(self, messages):
        return [ord(c) for c in messages[-1]["content"]]

    def encode_text(self, text):
        return [ord(c) for c in text]

    def free_slots(self):
        return self.max_batch - len(self.running) - len(self.waiting)

    def add(self, request):
        self.waiting.append(request)

    def cancel(self, request_id):
        if self.running.pop(request_id, None) is not None:
            self.out.append(Event(request_id, finish_reason="cancelled"))

    def step(self):
        self.gate.wait(10)
        self.steps += 1
        for r in self.waiting:  # admitted into the running batch between steps
            self.running[r.id] = [r, 0]
        self.waiting = []
        events, self.out = self.out, []
        for rid, state in list(self.running.items()):
            r, done = state
            if self.fail_on and chr(r.prompt[0]) == self.fail_on:
                raise RuntimeError("boom")
            events.append(Event(rid, text=chr(r.prompt[done])))
            state[1] += 1
            if state[1] >= min(r.max_tokens, len(r.prompt)):
                del self.running[rid]
                events.append(Event(rid, finish_reason="length" if r.max_tokens < len(r.prompt) else "stop",
                                    stats=RequestStats(len(r.prompt), state[1], state[1], 1.0, [state[1]], 0.01)))
        return events

    def active(self):
        return len(self.running)

    def pending(self):
        return len(self.waiting)

    def close(self):
        self.running.clear()
        self.waiting.clear()


def req(rid, text, max_tokens=100):
    return GenRequest(rid, [ord(c) for c in text], max_tokens)


async def collect(handle, timeout=10):
    """``(text, final event)`` of a request; a timeout (not a hang) when its final event never comes."""
    async def drain():
        text, last = [], None
        async for ev in handle.events():
            text.append(ev.text)
            last = ev
        return "".join(text), last

    return await asyncio.wait_for(drain(), timeout)


async def until(condition, timeout=5.0):
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out waiting for the engine")


def test_engine_runs_requests_and_admits_them_between_steps():
    async def run():
        backend = FakeBackend(max_batch=2)
        engine = Engine(backend, max_queue=8)
        engine.start()
        try:
            handles = [engine.submit(req(f"r{i}", "abcdef"[: i + 2])) for i in range(4)]
            results = await asyncio.gather(*(collect(h) for h in handles))
        finally:
            engine.stop()
        return results, backend

    results, backend = asyncio.run(run())
    assert [r[0] for r in results] == ["ab", "abc", "abcd", "abcde"]
    assert all(r[1].finish_reason == "stop" and r[1].stats.completion_tokens == len(r[0]) for r in results)


def test_engine_queue_bound_and_cancelling_a_waiting_request():
    async def run():
        backend = FakeBackend(max_batch=1)
        backend.gate.clear()
        engine = Engine(backend, max_queue=1)
        engine.start()
        try:
            first = engine.submit(req("a", "xyz"))
            for _ in range(100):  # the worker takes it into the backend (then blocks in step)
                if engine.queue_depth() == 0:
                    break
                await asyncio.sleep(0.01)
            second = engine.submit(req("b", "uvw"))
            with pytest.raises(QueueFull):
                engine.submit(req("c", "nope"))
            engine.cancel("b")
            backend.gate.set()
            return await collect(first), await collect(second), engine.open_requests()
        finally:
            engine.stop()

    (t1, e1), (t2, e2), left = asyncio.run(run())
    assert t1 == "xyz" and e1.finish_reason == "stop"
    assert t2 == "" and e2.finish_reason == "cancelled"
    assert left == 0


def test_a_failing_backend_step_fails_its_requests_and_the_engine_keeps_serving():
    async def run():
        backend = FakeBackend(max_batch=2, fail_on="!")
        engine = Engine(backend, max_queue=4)
        engine.start()
        try:
            bad = await collect(engine.submit(req("bad", "!!")))
            backend.fail_on = None
            good = await collect(engine.submit(req("good", "ok")))
            return bad, good
        finally:
            engine.stop()

    (_, bad), (text, good) = asyncio.run(run())
    assert bad.finish_reason == "error" and "boom" in bad.error
    assert text == "ok" and good.finish_reason == "stop"


def test_max_queue_zero_takes_requests_while_batch_slots_are_free():
    async def run():
        backend = FakeBackend(max_batch=2)
        backend.gate.clear()
        engine = Engine(backend, max_queue=0)
        engine.start()
        try:
            handles = [engine.submit(req("a", "ab")), engine.submit(req("b", "cd"))]  # the two free slots
            with pytest.raises(QueueFull):
                engine.submit(req("c", "ef"))
            await until(lambda: backend.free_slots() == 0 and engine.queue_depth() == 0)
            with pytest.raises(QueueFull):  # no free slot, and nothing may wait
                engine.submit(req("d", "gh"))
            backend.gate.set()
            return await asyncio.gather(*(collect(h) for h in handles))
        finally:
            engine.stop()

    assert [(text, ev.finish_reason) for text, ev in asyncio.run(run())] == [("ab", "stop"), ("cd", "stop")]


def test_max_queue_n_lets_n_wait_beyond_the_free_slots_even_during_a_step():
    async def run():
        backend = FakeBackend(max_batch=3)
        backend.gate.clear()
        engine = Engine(backend, max_queue=2)
        engine.start()
        try:
            handles = [engine.submit(req("a", "a"))]
            await until(lambda: engine.queue_depth() == 0 and backend.waiting)  # the worker is inside step()
            handles += [engine.submit(req(f"r{i}", "xy")) for i in range(4)]  # 2 free slots + 2 waiting
            with pytest.raises(QueueFull):
                engine.submit(req("over", "z"))
            backend.gate.set()
            return await asyncio.gather(*(collect(h) for h in handles))
        finally:
            engine.stop()

    assert [(text, ev.finish_reason) for text, ev in asyncio.run(run())] == [("a", "stop")] + [("xy", "stop")] * 4


class FailingBackend(FakeBackend):
    """A FakeBackend whose ``add`` and ``cancel`` raise for the request ids in ``bad_adds`` / ``bad_cancels``."""

    def __init__(self, bad_adds=(), bad_cancels=(), **kw):
        super().__init__(**kw)
        self.bad_adds, self.bad_cancels = set(bad_adds), set(bad_cancels)

    def add(self, request):
        if request.id in self.bad_adds:
            raise RuntimeError(f"cannot add {request.id}")
        super().add(request)

    def cancel(self, request_id):
        if request_id in self.bad_cancels:
            raise RuntimeError(f"cannot cancel {request_id}")
        super().cancel(request_id)


def test_a_failing_add_fails_that_request_and_the_engine_keeps_serving(caplog):
    async def run():
        engine = Engine(FailingBackend(bad_adds={"bad"}, max_batch=2), max_queue=4)
        engine.start()
        try:
            bad, good = engine.submit(req("bad", "no")), engine.submit(req("good", "ok"))
            return await collect(bad), await collect(good), await collect(engine.submit(req("later", "yes")))
        finally:
            engine.stop()

    with caplog.at_level(logging.ERROR, logger="poss.serve"):
        (text, bad), (good_text, good), (later_text, later) = asyncio.run(run())
    assert text == "" and bad.finish_reason == "error" and bad.error == "RuntimeError: cannot add bad"
    assert good_text == "ok" and good.finish_reason == "stop"
    assert later_text == "yes" and later.finish_reason == "stop"
    assert any("add failed" in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_failing_cancel_fails_that_request_and_the_engine_keeps_serving(caplog):
    async def run():
        backend = FailingBackend(bad_cancels={"bad"}, max_batch=2)
        backend.gate.clear()
        engine = Engine(backend, max_queue=4)
        engine.start()
        try:
            bad, good = engine.submit(req("bad", "abc")), engine.submit(req("good", "ok"))
            await until(lambda: engine.queue_depth() == 0)
            engine.cancel("bad")
            backend.gate.set()
            return await collect(bad), await collect(good)
        finally:
            engine.stop()

    with caplog.at_level(logging.ERROR, logger="poss.serve"):
        (_, bad), (good_text, good) = asyncio.run(run())
    assert bad.finish_reason == "error" and bad.error == "RuntimeError: cannot cancel bad"
    assert good_text == "ok" and good.finish_reason == "stop"
    assert any("cancel failed" in r.getMessage() and r.exc_info for r in caplog.records)


def test_an_unexpected_worker_failure_ends_open_requests_and_stops_the_engine():
    class Broken(FakeBackend):
        def has_work(self):
            if self.running:
                raise RuntimeError("lost track")
            return super().has_work()

    async def run():
        engine = Engine(Broken(max_batch=1), max_queue=4)
        engine.start()
        try:
            handles = [engine.submit(req("a", "abc")), engine.submit(req("b", "def"))]
            results = await asyncio.gather(*(collect(h) for h in handles))
            return results, engine.running, engine.open_requests()
        finally:
            engine.stop()

    results, running, left = asyncio.run(run())
    assert all(ev.finish_reason == "error" and "lost track" in ev.error for _, ev in results)
    assert not running and left == 0


@pytest.fixture
def fake_server():
    """The real app on a FakeBackend (max batch 1, queue 1), served by uvicorn in a thread."""
    backend = FakeBackend(max_batch=1)
    engine = Engine(backend, max_queue=1)
    app = create_app(engine, "fake", default_max_tokens=8)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    yield url, backend, engine
    backend.gate.set()
    server.should_exit = True
    thread.join(15)


def test_a_full_queue_answers_429_and_the_server_recovers(fake_server):
    url, backend, engine = fake_server
    backend.gate.clear()
    body = {"model": "fake", "prompt": "hello", "max_tokens": 5}

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            first = asyncio.ensure_future(c.post("/v1/completions", json=body))  # decoding (blocked)
            for _ in range(200):
                if engine.open_requests() == 1 and engine.queue_depth() == 0:
                    break
                await asyncio.sleep(0.01)
            second = asyncio.ensure_future(c.post("/v1/completions", json=body))  # waits in the queue
            for _ in range(200):
                if engine.queue_depth() == 1:
                    break
                await asyncio.sleep(0.01)
            third = await c.post("/v1/completions", json=body)  # over the bound
            health = await c.get("/health")  # answers while the backend is busy
            backend.gate.set()
            return await first, await second, third, health

    first, second, third, health = asyncio.run(run())
    assert third.status_code == 429
    assert third.json()["error"]["code"] == "queue_full" and third.json()["error"]["type"] == "rate_limit_error"
    assert health.status_code == 200 and health.json()["queue_depth"] == 1
    assert first.json()["choices"][0]["text"] == "hello" and second.json()["choices"][0]["text"] == "hello"
    assert httpx.post(url + "/v1/completions", json=body, timeout=10).json()["choices"][0]["text"] == "hello"


def test_streaming_with_a_continuous_backend_needs_no_http_change(fake_server):
    url, backend, _ = fake_server
    body = {"model": "fake", "messages": [{"role": "user", "content": "stream"}], "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    import json

    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "stream"
    assert chunks[-1]["usage"]["completion_tokens"] == 6
