"""OpenAI request validation and response shapes: plain dicts in, plain dicts out (no HTTP, no model).

Every rejection is an :class:`APIError` that renders as OpenAI's error object
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status.
"""

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from poss.decode.params import MAX_TOP_K, MIN_TEMPERATURE, SamplingParams

MAX_STOP_STRINGS = 16
ROLES = ("system", "developer", "user", "assistant", "tool")
# Parameters whose requested behaviour poss does not implement: a clear 400 instead of silently
# ignoring them (a value equal to the default is accepted).
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "suffix": (None, ""), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "logit_bias": (None, {}), "tools": (None, []), "functions": (None, [])}


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class Params:
    """A validated completion request (tokenization and the context check come later)."""

    kind: str  # "chat" or "completion"
    model: str
    messages: Optional[List[dict]] = None
    prompt: Optional[Union[str, List[int]]] = None
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: Tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    extra: Dict[str, Any] = field(default_factory=dict)


def parse_json(raw: bytes) -> Dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", code="invalid_json")
    return body


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _type_error(name: str, expected: str, value) -> APIError:
    return bad(f"'{name}' must be {expected}, got {type(value).__name__} {json.dumps(value)[:60]}", param=name,
               code="invalid_type")


def _get(body, name, check, expected, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise _type_error(name, expected, v)
    return v


def _message_text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text parts are understood
        out = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"messages[{i}].content: only text content parts are supported",
                          param=f"messages[{i}].content", code="invalid_type")
            out.append(part["text"])
        return "".join(out)
    raise _type_error(f"messages[{i}].content", "a string or a list of text parts", content)


def _messages(body) -> List[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad("'messages' is a required property", param="messages", code="missing_required_parameter")
    if not isinstance(msgs, list):
        raise _type_error("messages", "an array of messages", msgs)
    if not msgs:
        raise bad("'messages' must hold at least one message", param="messages", code="invalid_value")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _type_error(f"messages[{i}]", "an object", m)
        role = m.get("role")
        if role is None:
            raise bad(f"messages[{i}].role is a required property", param=f"messages[{i}].role",
                      code="missing_required_parameter")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {json.dumps(role)[:40]}",
                      param=f"messages[{i}].role", code="invalid_value")
        content = m.get("content")
        if content is None and role != "assistant":
            raise bad(f"messages[{i}].content is a required property", param=f"messages[{i}].content",
                      code="missing_required_parameter")
        out.append({"role": role, "content": "" if content is None else _message_text(content, i)})
    return out


def _prompt(body) -> Union[str, List[int]]:
    p = body.get("prompt")
    if p is None:
        raise bad("'prompt' is a required property", param="prompt", code="missing_required_parameter")
    # OpenAI accepts a string, a token array, or a batch of either: poss takes one prompt per request.
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise bad("'prompt' is empty: there is no token to continue from", param="prompt", code="invalid_value")
        return p
    if isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p):
        return list(p)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise bad("only one prompt per request is supported (send one request per prompt)", param="prompt",
                  code="invalid_value")
    raise _type_error("prompt", "a non-empty string or array of token ids", p)


def parse_request(body: Dict[str, Any], kind: str) -> Params:
    """Validate a chat (``kind="chat"``) or completion (``"completion"``) request body."""
    model = body.get("model")
    if model is None:
        raise bad("'model' is a required property", param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    p = Params(kind=kind, model=model)
    if kind == "chat":
        p.messages = _messages(body)
    else:
        p.prompt = _prompt(body)
    names = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    for name in names:
        v = _get(body, name, _is_int, "an integer")
        if v is not None and v < 1:
            raise bad(f"'{name}' must be at least 1, got {v}", param=name, code="invalid_value")
        if v is not None and p.max_tokens is None:
            p.max_tokens = v
    p.temperature = float(_get(body, "temperature", _is_number, "a number", 1.0))
    if not (p.temperature == 0 or MIN_TEMPERATURE <= p.temperature <= 2):
        raise bad(f"'temperature' must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, 2], got {p.temperature}",
                  param="temperature", code="invalid_value")
    p.top_p = float(_get(body, "top_p", _is_number, "a number", 1.0))
    if not 0 < p.top_p <= 1:
        raise bad(f"'top_p' must be in (0, 1], got {p.top_p}", param="top_p", code="invalid_value")
    p.top_k = _get(body, "top_k", _is_int, "an integer", 0)
    if not 0 <= p.top_k <= MAX_TOP_K:
        raise bad(f"'top_k' must be in [0, {MAX_TOP_K}] (0: off), got {p.top_k}", param="top_k", code="invalid_value")
    p.seed = _get(body, "seed", _is_int, "an integer")
    # What passes here must also pass SamplingParams (float32 top_p, 64-bit seed): a request failing
    # inside the batch would fail the requests decoding beside it.
    for name in ("top_p", "seed"):
        try:
            SamplingParams(**{name: getattr(p, name)})
        except ValueError as exc:
            raise bad(f"'{name}': {exc}", param=name, code="invalid_value") from None
    n = _get(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise bad(f"'n' must be 1: poss returns one choice per request, got n={n}", param="n", code="invalid_value")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _type_error("stop", "a string or an array of strings", stop)
    if stop and len(stop) > MAX_STOP_STRINGS:
        raise bad(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop",
                  code="invalid_value")
    p.stop = tuple(s for s in (stop or ()) if s)
    p.stream = _get(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    opts = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    if opts is not None:
        if not p.stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", param="stream_options",
                      code="invalid_value")
        p.include_usage = _get(opts, "include_usage", lambda v: isinstance(v, bool), "a boolean", False)
    for name, defaults in UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and not any(v == d for d in defaults if d is not None):
            raise bad(f"'{name}' is not supported by poss serve", param=name, code="unsupported_parameter")
    return p


# -- responses ------------------------------------------------------------------------------------
def request_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> Dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def poss_info(stats) -> Dict[str, Any]:
    return {"tau": stats.tau, "accept_hist": list(stats.accept_hist), "rounds": stats.rounds,
            "seconds": stats.seconds}


def completion_body(p: Params, rid: str, created: int, text: str, finish_reason: str, stats) -> Dict[str, Any]:
    if p.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": p.model, "choices": [choice],
            "usage": usage(stats.prompt_tokens, stats.completion_tokens), "poss": poss_info(stats)}


def chunk_body(p: Params, rid: str, created: int, text: Optional[str] = None, finish_reason: Optional[str] = None,
               role: bool = False, stats=None) -> Dict[str, Any]:
    """One SSE chunk: a text delta, the opening role delta (chat), or the final one with ``finish_reason``."""
    if p.kind == "chat":
        delta: Dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": created, "model": p.model, "choices": [choice]}
    if p.include_usage:
        body["usage"] = None
    if stats is not None:
        body["poss"] = poss_info(stats)
    return body


def usage_chunk(p: Params, rid: str, created: int, stats) -> Dict[str, Any]:
    obj = "chat.completion.chunk" if p.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": p.model, "choices": [],
            "usage": usage(stats.prompt_tokens, stats.completion_tokens)}


def sse(data: Union[Dict[str, Any], str]) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n".encode()


def now() -> int:
    return int(time.time())
