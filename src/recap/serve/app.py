"""The HTTP side: OpenAI-compatible chat completions, models, health, metrics, playground.

Every error is ``{"error": {"message", "type", "code"}}`` with its status; a 500 never shows
a traceback. Requests are validated and their inputs prepared here (so a bad request is
answered at once), then queued for the single decoding thread (`recap.serve.engine`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from recap.errors import InputError
from recap.serve.chat import ApiError, chunk, completion, completion_id, finish_reason, parse_chat_request
from recap.serve.engine import Engine, Job, QueueFull
from recap.serve.metrics import Metrics
from recap.serve.tenants import TenantStreams, tenant_for
from recap.target import TargetModel

log = logging.getLogger("recap.serve")


@dataclass
class ServerConfig:
    model_name: str
    method: str = "recap"
    api_keys: dict[str, str] | None = None
    """key -> tenant; None: one tenant, no authentication (loopback only, checked by the CLI)."""
    memory_dir: str | None = None
    memory_rows: int | None = 16384
    """Bound of each tenant's RECAP token memory (rows); None: one row per vocabulary token."""
    max_queue: int = 64
    max_tokens_limit: int = 1024
    request_timeout: float = 300.0
    max_body_bytes: int = 16 * 1024 * 1024
    allow_local_images: bool = False


def create_app(target: TargetModel, config: ServerConfig) -> FastAPI:
    tenants = TenantStreams(config.method, target.vocab_size, config.memory_dir, config.memory_rows)
    metrics = Metrics(lambda: engine.depth)  # read at scrape time, once the engine exists

    def on_finish(job: Job, event: dict) -> None:
        if event["type"] == "done":
            metrics.requests.labels("ok").inc()
            metrics.completion_tokens.inc(event["usage"]["completion_tokens"])
            metrics.prompt_tokens.inc(event["usage"]["prompt_tokens"])
            metrics.drafted_tokens.inc(event["recap"]["drafted_tokens"])
            metrics.accepted_tokens.inc(event["recap"]["accepted_tokens"])
            metrics.tau.observe(event["recap"]["tau"])
            metrics.latency.observe(time.monotonic() - job.submitted)
        else:
            metrics.requests.labels(str(event.get("status", 500))).inc()

    engine = Engine(target, tenants, max_queue=config.max_queue, on_finish=on_finish)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await run_in_threadpool(engine.shutdown)
        log.info("memories saved; bye")

    app = FastAPI(title="RECAP", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.tenants, app.state.metrics = engine, tenants, metrics

    # ------------------------------------------------------------------ errors
    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return JSONResponse(ApiError(error.status_code, str(error.detail), code=code).body(),
                            status_code=error.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        log.exception("unhandled error")
        return JSONResponse(ApiError(500, "internal server error", type="server_error").body(), status_code=500)

    # ------------------------------------------------------------------ plain endpoints
    def tenant_of(request: Request) -> str:
        tenant = tenant_for(config.api_keys, request.headers.get("authorization"))
        if tenant is None:
            raise ApiError(401, "a valid API key is required (Authorization: Bearer <key>)",
                           type="authentication_error", code="invalid_api_key")
        return tenant

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        page = resources.files("recap.serve").joinpath("playground.html").read_text(encoding="utf-8")
        return HTMLResponse(page.replace("{{MODEL}}", config.model_name).replace(
            "{{KEYS}}", "true" if config.api_keys else "false"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": config.model_name, "method": config.method, "queue": engine.depth,
                "busy": engine.busy}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        tenant_of(request)
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "recap"}]}

    # ------------------------------------------------------------------ chat completions
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrived = time.monotonic()
        tenant = tenant_of(request)
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise ApiError(413, f"the request is larger than {config.max_body_bytes} bytes", type="request_too_large")
        raw = await request.body()
        if len(raw) > config.max_body_bytes:
            raise ApiError(413, f"the request is larger than {config.max_body_bytes} bytes", type="request_too_large")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
        chat = await run_in_threadpool(parse_chat_request, body, allow_local_images=config.allow_local_images)
        if chat.model != config.model_name:
            raise ApiError(404, f"model {chat.model!r} is not served here; this server serves {config.model_name!r}",
                           code="model_not_found")
        if chat.image is not None and not target.accepts_images:
            raise ApiError(400, f"{config.model_name} is a text-only model: it cannot take an image",
                           code="image_not_supported")
        try:
            inputs = await run_in_threadpool(target.prepare, chat.messages, chat.image)
        except InputError as error:
            raise ApiError(400, str(error)) from None
        prompt_len = inputs.input_ids.shape[1]
        room = target.max_context - prompt_len
        max_tokens = chat.max_tokens if chat.max_tokens is not None else min(config.max_tokens_limit, room)
        if max_tokens > config.max_tokens_limit:
            raise ApiError(400, f"max_tokens {max_tokens} is above this server's limit of {config.max_tokens_limit}",
                           code="max_tokens_too_large")
        if max_tokens > room:
            raise ApiError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                                f"context of {target.max_context} tokens", code="context_length_exceeded")

        loop = asyncio.get_running_loop()
        events: asyncio.Queue[dict] = asyncio.Queue()
        job = Job(tenant=tenant, inputs=inputs, max_tokens=max_tokens, sampling=chat.sampling,
                  emit=lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
                  deadline=arrived + config.request_timeout, submitted=arrived)
        try:
            engine.submit(job)
        except QueueFull as error:
            raise ApiError(429, f"the server is busy: {error}; retry later", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        request_id = completion_id()
        if chat.stream:
            return StreamingResponse(_stream(request_id, job, events, chat.include_usage, arrived),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _collect(request, request_id, job, events)

    async def _collect(request: Request, request_id: str, job: Job, events: asyncio.Queue) -> JSONResponse:
        try:
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        job.cancel()
                    continue
                if event["type"] == "done":
                    return JSONResponse(completion(request_id, config.model_name, event["text"],
                                                   event["stop_reason"], event["usage"], event["recap"]))
                if event["type"] == "error":
                    raise ApiError(event.get("status", 500), event["message"],
                                   type="server_error" if event.get("status", 500) >= 500 else "request_error")
        finally:
            job.cancel()  # a no-op once the job is done; frees the decoder if the client went away

    async def _stream(request_id: str, job: Job, events: asyncio.Queue, include_usage: bool, arrived: float):
        model = config.model_name
        first = True
        try:
            yield _sse(chunk(request_id, model, {"role": "assistant", "content": ""}))
            while True:
                event = await events.get()
                if event["type"] == "text":
                    if first:
                        metrics.first_token.observe(time.monotonic() - arrived)
                        first = False
                    yield _sse(chunk(request_id, model, {"content": event["text"]},
                                     recap={"drafted_text": event["drafted_text"], "tokens": event["tokens"],
                                            "drafted": event["drafted"]}))
                elif event["type"] == "done":
                    yield _sse(chunk(request_id, model, {}, finish_reason(event["stop_reason"])))
                    if include_usage:
                        yield _sse({**chunk(request_id, model, {}), "choices": [], "usage": event["usage"],
                                    "recap": event["recap"]})
                    break
                else:
                    status = event.get("status", 500)
                    yield _sse(ApiError(status, event["message"],
                                        type="server_error" if status >= 500 else "request_error").body())
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()  # the client went away mid-stream: the decoder stops at its next step

    return app


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
