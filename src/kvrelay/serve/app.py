"""The FastAPI application: ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``.

Errors are OpenAI error bodies (``{"error": {"message", "type", "param", "code"}}``): 400 for a bad
request, 404 for an unknown model or route, 405 for a wrong method, 503 while shutting down, 500
for a server fault. Streaming answers are server-sent events, one ``chat.completion.chunk`` per
decoded piece of text, the last one carrying ``finish_reason`` and the ``kvrelay`` extension
(handle, per-handle channel), then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrelay.core.errors import InvalidInput
from kvrelay.serve import handles
from kvrelay.serve.metrics import Metrics
from kvrelay.serve.pool import Pool
from kvrelay.serve.protocol import (
    ChatRequest,
    RequestError,
    chunk_body,
    completion_body,
    error_body,
    models_body,
    parse_chat,
)
from kvrelay.serve.replica import Replica, Result
from kvrelay.serve.scheduler import Decision

AUTO = "auto"  # the model name that lets the scheduler choose
DROPPED = "the scheduler answered without this handle: its policy predicts no loss from leaving it out"


def _error(status: int, body: dict) -> JSONResponse:
    return JSONResponse(body, status_code=status)


def create_app(pool: Pool, secret: bytes, *, default_max_tokens: int = 128, limit_max_tokens: int = 2048,
               decide: Callable[[ChatRequest, list[handles.Opened]], Decision] | None = None) -> FastAPI:
    """The server over ``pool``. ``decide(req, opened)`` picks the model for ``model: "auto"``
    (``serve.scheduler.Scheduler.decide``); without it ``auto`` is not offered."""
    metrics = Metrics(pool.depth, pool.models)
    for r in pool.all():
        r.observers.append(metrics.observe)
    state = {"closing": False, "started": int(time.time())}

    def _label(body) -> str:  # a metrics label: a served model, never a client's arbitrary string
        m = body.get("model") if isinstance(body, dict) else None
        return m if m in pool.models else "unknown"

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        state["closing"] = True  # uvicorn has drained open requests; finish what the replicas still hold
        await asyncio.to_thread(pool.close)

    app = FastAPI(title="kvrelay serve", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.pool, app.state.metrics, app.state.flags = pool, metrics, state

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        msg = {404: f"no route {request.method} {request.url.path}; expected /v1/chat/completions, /v1/models, "
                    "/health or /metrics",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                       str(exc.detail))
        return _error(exc.status_code, error_body(msg, kind))

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception):
        return _error(500, error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"))

    @app.get("/health")
    async def health():
        if state["closing"]:
            return _error(503, {"status": "shutting down"})
        return {"status": "ok", "models": pool.models, "queue": {m: pool.depth(m) for m in pool.models}}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def list_models():
        return models_body(pool.models + ([AUTO] if decide is not None else []),
                           state["started"])

    @app.get("/v1/models/{model}")
    async def one_model(model: str):
        if model not in pool.models:
            return _error(404, error_body(f"the model {model!r} does not exist; expected one of "
                                          f"{', '.join(pool.models)}", "invalid_request_error", "model",
                                          "model_not_found"))
        return models_body([model], state["started"])["data"][0]

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if state["closing"]:
            return _error(503, error_body("the server is shutting down; expected a retry elsewhere", "server_error"))
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, error_body("the request body is not JSON; expected a JSON object"))
        try:
            req = parse_chat(body, default_max_tokens=default_max_tokens, limit_max_tokens=limit_max_tokens)
            opened = [handles.decode(h, secret, f"kv_context[{i}]") for i, h in enumerate(req.kv_context)]
            model, decision = req.model, None
            if model == AUTO and decide is not None:
                decision = decide(req, opened)
                model = decision.model
                metrics.decided(decision)
            if model not in pool.models:
                raise RequestError(f"the model {model!r} does not exist; expected one of {', '.join(pool.models)}",
                                   status=404, param="model", code="model_not_found")
        except InvalidInput as err:  # a kv_context entry that is not a handle at all
            metrics.refused(_label(body), 400)
            return _error(400, error_body(str(err), param="kv_context"))
        except RequestError as err:
            metrics.refused(_label(body), err.status)
            return _error(err.status, err.body())
        replica = pool.pick(model)
        given = opened
        if decision is not None and decision.channel == "none":
            opened = []  # the scheduler's policy answers without the handles (the response lists them)
        if req.stream:
            return await _stream(replica, req, opened, model, decision, given)
        try:
            res: Result = await asyncio.wrap_future(replica.submit(req, opened))
        except RequestError as err:
            metrics.refused(model, err.status)
            return _error(err.status, err.body())
        return completion_body(req, model, res.text, res.finish, res.usage, _ext(res, model, decision, given))

    async def _stream(replica: Replica, req: ChatRequest, opened, model: str, decision, given):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_text(piece: str) -> None:  # the replica's worker thread
            loop.call_soon_threadsafe(events.put_nowait, ("text", piece))

        fut = replica.submit(req, opened, on_text)
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(events.put_nowait, ("done", f)))
        first = await events.get()  # the first piece, or the end (an error, or an empty answer)
        if first[0] == "done" and first[1].exception() is not None:
            err = first[1].exception()
            if isinstance(err, RequestError):
                metrics.refused(model, err.status)
                return _error(err.status, err.body())
            raise err

        async def sse():
            yield _sse(chunk_body(req, model, {"role": "assistant", "content": ""}))
            ev = first
            while ev[0] == "text":
                yield _sse(chunk_body(req, model, {"content": ev[1]}))
                ev = await events.get()
            f = ev[1]
            if f.exception() is not None:
                yield _sse(error_body(str(f.exception()), "server_error"))
            else:
                res: Result = f.result()
                yield _sse(chunk_body(req, model, {}, res.finish, _ext(res, model, decision, given)))
                if req.include_usage:
                    yield _sse(chunk_body(req, model, {}, usage=res.usage, choices=False))
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


def _ext(res: Result, model: str, decision: Decision | None, given) -> dict:
    ext = res.ext(model)
    if decision is None:
        return ext
    if decision.channel == "none" and given:  # left out by the scheduler: channel "none", no tokens read
        ext["context"] = [{"index": i, "channel": "none", "tokens": 0, "detail": DROPPED} for i in range(len(given))]
    return ext | {"scheduler": decision.to_json()}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
