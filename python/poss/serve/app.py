"""The FastAPI app: OpenAI endpoints on an :class:`~poss.serve.engine.Engine`.

``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream`` true: server-sent events
``data: {...}`` then ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.
Every error is OpenAI's JSON error object with a 4xx/5xx status; the server keeps serving.
"""

import asyncio
import logging
import threading
from contextlib import asynccontextmanager
from typing import Any, Dict, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from poss.serve import protocol as proto
from poss.serve.backend import GenRequest
from poss.serve.engine import Engine, EngineStopped, QueueFull
from poss.serve.protocol import APIError, bad

log = logging.getLogger("poss.serve")
MAX_BODY = 1 << 20  # bytes
_DRAIN_LIMIT = 64 << 20  # read (and drop) an oversized body up to this, so the client gets its 413


def create_app(engine: Engine, model_name: str, default_max_tokens: int = 512, max_body: int = MAX_BODY,
               model_info: Optional[Dict[str, Any]] = None, on_started=None) -> FastAPI:
    """The app for ``engine``; ``model_name`` is the only ``model`` it accepts. The engine starts and
    stops with the app (lifespan); ``on_started()`` runs once it runs."""
    backend, metrics = engine.backend, engine.metrics
    created = proto.now()
    encode_lock = threading.Lock()

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        if on_started is not None:
            on_started()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="poss serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    # -- errors -----------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(exc.status_code, str(exc.detail), type=kind, code=str(exc.status_code))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(bad(str(exc)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error")
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    # -- helpers ----------------------------------------------------------------------------------
    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                declared_n = int(declared)
            except ValueError:
                raise bad("invalid Content-Length header") from None
            if declared_n > _DRAIN_LIMIT:
                raise APIError(413, f"the request body is {declared_n} bytes, over the limit of {max_body}",
                               code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size <= max_body:
                chunks.append(chunk)
            elif size > _DRAIN_LIMIT:
                break
        if size > max_body:
            raise APIError(413, f"the request body is over the limit of {max_body} bytes", code="request_too_large")
        return b"".join(chunks)

    def encode(p: proto.Params):
        with encode_lock:
            if p.kind == "chat":
                return backend.encode_chat(p.messages), "messages"
            if isinstance(p.prompt, list):
                return list(p.prompt), "prompt"
            return backend.encode_text(p.prompt), "prompt"

    async def prepare(request: Request, kind: str):
        body = proto.parse_json(await read_body(request))
        p = proto.parse_request(body, kind)
        if p.model != model_name:
            raise APIError(404, f"The model '{p.model}' does not exist: this server serves '{model_name}'",
                           param="model", code="model_not_found")
        try:
            ids, param = await asyncio.to_thread(encode, p)
        except Exception as exc:  # the input's fault (e.g. roles the chat template refuses)
            raise bad(f"could not tokenize the {'messages' if p.kind == 'chat' else 'prompt'}: {exc}") from None
        vocab = getattr(backend, "vocab_size", None)
        if vocab and any(t >= vocab for t in ids):
            raise bad(f"'prompt' has token ids outside the vocabulary (size {vocab})", param=param,
                      code="invalid_value")
        limit = backend.context_limit
        if not ids:
            raise bad(f"'{param}' encodes to no tokens: there is no token to continue from", param=param,
                      code="invalid_value")
        if len(ids) >= limit:
            raise bad(f"This model's maximum context length is {limit} tokens; the {param} take {len(ids)} "
                      f"tokens, leaving no room to generate", param=param, code="context_length_exceeded")
        max_tokens = p.max_tokens if p.max_tokens is not None else min(default_max_tokens, limit - len(ids))
        rid = proto.request_id(kind)
        req = GenRequest(rid, ids, max_tokens, p.temperature, p.top_k, p.top_p, p.seed, p.stop)
        try:
            handle = engine.submit(req)
        except QueueFull as exc:
            raise APIError(429, f"{exc}: retry later", type="rate_limit_error", code="queue_full") from None
        except EngineStopped as exc:
            raise APIError(503, str(exc), type="server_error", code="unavailable") from None
        return p, rid, handle

    async def completion(request: Request, kind: str, endpoint: str):
        try:
            p, rid, handle = await prepare(request, kind)
        except APIError:
            metrics.requests.labels(endpoint, "rejected").inc()
            raise
        created = proto.now()
        if p.stream:
            return StreamingResponse(stream(request, p, rid, created, handle, endpoint), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        texts, final = [], None
        try:
            while final is None:
                try:
                    ev = await asyncio.wait_for(handle.queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        break
                    continue
                texts.append(ev.text)
                if ev.finished:
                    final = ev
        finally:
            if not handle.finished:
                engine.cancel(rid)
        outcome = final.finish_reason if final is not None else "cancelled"
        metrics.requests.labels(endpoint, outcome).inc()
        if final is None or final.finish_reason == "cancelled":
            return Response(status_code=499)
        if final.finish_reason == "error":
            raise APIError(500, final.error or "generation failed", type="server_error")
        return JSONResponse(proto.completion_body(p, rid, created, "".join(texts), final.finish_reason, final.stats))

    async def stream(request, p, rid, created, handle, endpoint):
        outcome = "cancelled"
        try:
            if p.kind == "chat":
                yield proto.sse(proto.chunk_body(p, rid, created, text="", role=True))
            async for ev in handle.events():
                if ev.text:
                    yield proto.sse(proto.chunk_body(p, rid, created, text=ev.text))
                if not ev.finished:
                    continue
                outcome = ev.finish_reason
                if ev.finish_reason in ("error", "cancelled"):
                    err = APIError(500, ev.error or "the request was cancelled", type="server_error")
                    yield proto.sse(err.body())
                else:
                    yield proto.sse(proto.chunk_body(p, rid, created, text="" if p.kind == "chat" else None,
                                                     finish_reason=ev.finish_reason, stats=ev.stats))
                    if p.include_usage:
                        yield proto.sse(proto.usage_chunk(p, rid, created, ev.stats))
            yield proto.sse("[DONE]")
        finally:
            if not handle.finished:
                engine.cancel(rid)
            metrics.requests.labels(endpoint, outcome).inc()

    # -- endpoints --------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completion(request, "chat", "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion(request, "completion", "completions")

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "poss"}
        if model_info:
            card["poss"] = model_info
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        body = {"status": "ok" if engine.running else "stopped", "queue_depth": engine.queue_depth(),
                "active": engine.active(), "open_requests": engine.open_requests()}
        return JSONResponse(body, status_code=200 if engine.running else 503)

    @app.get("/metrics")
    async def prometheus():
        metrics.queue_depth.set(engine.queue_depth())
        return Response(metrics.render(), media_type=metrics.content_type)

    return app
