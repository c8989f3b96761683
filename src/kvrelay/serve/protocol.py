"""The OpenAI chat-completions wire shapes: a checked request in, response bodies and error bodies out.

Only what a greedy server can honour is accepted: ``n`` must be 1, sampling parameters are read
and ignored (decoding is greedy, so answers are reproducible), ``tools`` and ``stop`` are refused.
Extension fields (ignored by other servers): ``kv_context`` — context handles to continue from —
and ``kv_handle`` — whether to store this turn's cache and return a handle (default true).
Responses carry a ``kvrelay`` object: the handle, and per given handle whether its cache was used
or, if not, why (``docs/serve.md``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvrelay.core.errors import InvalidInput, KVRelayError
from kvrelay.serve.chat import ROLE_ALIASES, Message

REFUSED = ("tools", "functions", "audio")


class RequestError(KVRelayError):
    """A request the API refuses: an OpenAI error body with ``status``, ``type``, ``param`` and ``code``."""

    def __init__(self, message: str, *, status: int = 400, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        self.status, self.type, self.param, self.code = status, type_, param, code
        super().__init__(message)

    def body(self) -> dict:
        return error_body(str(self), self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _bad(param: str, what: str, expected: str) -> RequestError:
    return RequestError(f"{what}; expected {expected}", param=param)


def _content(param: str, c: Any) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: text only
        out = []
        for i, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{param}[{i}]", "a content part that is not text", '{"type": "text", "text": "..."}')
            out.append(part["text"])
        return "".join(out)
    if c is None:
        return ""
    raise _bad(param, f"content of type {type(c).__name__}", "a string or a list of text parts")


def _messages(raw: Any) -> tuple[Message, ...]:
    if not isinstance(raw, list):
        raise _bad("messages", "messages is not a list", "a list of {role, content} objects")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or "role" not in m:
            raise _bad(f"messages[{i}]", "a message without a role", "an object with role and content")
        role = ROLE_ALIASES.get(m["role"], m["role"])
        try:
            out.append(Message(role, _content(f"messages[{i}].content", m.get("content"))))
        except InvalidInput as err:
            raise RequestError(str(err), param=f"messages[{i}].role") from None
    return tuple(out)


def _int(body: dict, name: str, lo: int, hi: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        raise _bad(name, f"{name}={v!r}", f"an integer in [{lo}, {hi}]" if hi else f"an integer >= {lo}")
    return v


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    messages: tuple[Message, ...]
    max_tokens: int
    stream: bool = False
    include_usage: bool = False
    kv_context: tuple[str, ...] = ()
    kv_handle: bool = True
    slo_s: float | None = None  # the caller's latency target for the whole answer (the scheduler reads it)
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        if not self.messages and not self.kv_context:
            raise _bad("messages", "no messages and no kv_context", "at least one message or a context handle")
        if self.max_tokens < 1:
            raise _bad("max_tokens", f"max_tokens={self.max_tokens}", "an integer >= 1")


def parse_chat(body: Any, *, default_max_tokens: int, limit_max_tokens: int) -> ChatRequest:
    """A checked ``ChatRequest`` from a JSON body, or ``RequestError`` naming the offending parameter."""
    if not isinstance(body, dict):
        raise RequestError("the request body is not a JSON object; expected {model, messages, ...}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "model is missing", "a model id from GET /v1/models")
    if "messages" not in body:
        raise _bad("messages", "messages is missing", "a list of {role, content} objects")
    for name in REFUSED:
        if body.get(name):
            raise _bad(name, f"{name} is not supported by this server", f"a request without {name}")
    if body.get("stop"):
        raise _bad("stop", "stop sequences are not supported", "no stop (answers end at the model's end of turn)")
    n = _int(body, "n", 1, 1)
    del n
    max_tokens = _int(body, "max_completion_tokens", 1, limit_max_tokens)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, limit_max_tokens)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", f"stream={stream!r}", "true or false")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _bad("stream_options", "stream_options is not an object", '{"include_usage": true}')
    ctx = body.get("kv_context") or []
    if not isinstance(ctx, list) or not all(isinstance(h, str) for h in ctx):
        raise _bad("kv_context", "kv_context is not a list of strings", "a list of handles from earlier responses")
    want = body.get("kv_handle", True)
    if not isinstance(want, bool):
        raise _bad("kv_handle", f"kv_handle={want!r}", "true or false")
    slo = body.get("kv_slo_s")
    if slo is not None and (not isinstance(slo, int | float) or isinstance(slo, bool) or slo <= 0):
        raise _bad("kv_slo_s", f"kv_slo_s={slo!r}", "a positive number of seconds")
    return ChatRequest(model, _messages(body["messages"]), max_tokens or default_max_tokens, stream,
                       bool(opts.get("include_usage", False)), tuple(ctx), want,
                       None if slo is None else float(slo))


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int  # every token the answer attended to before writing (relayed + prefilled)
    completion_tokens: int
    relayed_tokens: int  # of prompt_tokens, those that came as a cache

    def to_json(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.relayed_tokens}}


def completion_body(req: ChatRequest, model: str, text: str, finish: str, usage: Usage, ext: dict) -> dict:
    return {"id": req.id, "object": "chat.completion", "created": req.created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                         "logprobs": None}],
            "usage": usage.to_json(), "kvrelay": ext}


def chunk_body(req: ChatRequest, model: str, delta: dict, finish: str | None = None, ext: dict | None = None,
               usage: Usage | None = None, choices: bool = True) -> dict:
    d = {"id": req.id, "object": "chat.completion.chunk", "created": req.created, "model": model,
         "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}] if choices else []}
    if ext is not None:
        d["kvrelay"] = ext
    if usage is not None:
        d["usage"] = usage.to_json()
    return d


def models_body(names: list[str], created: int) -> dict:
    return {"object": "list", "data": [{"id": n, "object": "model", "created": created, "owned_by": "kvrelay"}
                                       for n in names]}
