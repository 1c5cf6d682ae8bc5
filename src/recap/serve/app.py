"""The HTTP side: OpenAI-compatible chat completions, models, health, metrics, playground.

Every error is ``{"error": {"message", "type", "code"}}`` with its status; a 500 never shows
a traceback, and no message shows a server path. A chat request is admitted before any work
that costs: the origin (keyless servers), the key, the content type, a queue slot, then the
body, read as it streams in and cut off at its limit; only then is its JSON parsed, its
model name checked, its image decoded and its prompt tokenised (one request at a time), and
the prepared job queued for the decoding thread, which batches requests step by step
(`recap.serve.engine`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError  # chat templates' refusals (torch and transformers' templates need jinja2)
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from recap.errors import InputError
from recap.serve.chat import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    ApiError,
    ChatRequest,
    ImagePolicy,
    check_image_url,
    chunk,
    completion,
    completion_id,
    finish_reason,
    parse_chat_request,
    parse_json_body,
    read_image_url,
)
from recap.serve.engine import Engine, Job, QueueFull, Unavailable
from recap.serve.metrics import Metrics
from recap.serve.tenants import (
    MIN_KEY_LENGTH,
    TenantStreams,
    distinct_tenants,
    strong_key,
    tenant_for,
    valid_tenant_name,
)
from recap.verifier import ModelInputs, TargetModel

log = logging.getLogger("recap.serve")
MIN_BODY_SECONDS = 1.0
"""A body may take at least this long to arrive, however short ``request_timeout`` is: a tiny
limit meant for decoding must not turn a body sent in two packets into a 408."""


@dataclass
class ServerConfig:
    model_name: str
    method: str = "recap"
    api_keys: dict[str, str] | None = None
    """key -> tenant; None: one tenant, no authentication, and only loopback origins and Host
    names are answered (see `LoopbackGuard`). Tenant names are checked (`valid_tenant_name`)."""
    memory_dir: str | None = None
    memory_rows: int | None = 16384
    """Bound of each tenant's RECAP token memory (rows); None: one row per vocabulary token."""
    max_queue: int = 64
    """Requests admitted and not yet decoding (being read, prepared or waiting) before a 429."""
    max_batch: int | None = None
    """Requests decoded together, one forward per step (continuous batching); None: the
    target's default (`recap.serve.engine.default_max_batch`)."""
    shared_budget: bool = True
    """Cost-aware drafters share one verification budget per step by expected gain; False:
    each request sizes its own tree as it would alone."""
    tenant_share: float = 0.5
    """With several tenants (API keys), the share of the server's request slots (its queue plus
    its batch lanes) one tenant may hold at once; past it that tenant gets 429
    ``tenant_share_exceeded`` while the others are still admitted. 1: no per-tenant limit."""
    max_tokens_limit: int = 1024
    request_timeout: float = 300.0
    max_body_bytes: int = 16 * 1024 * 1024
    max_image_bytes: int = MAX_IMAGE_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS
    max_image_tokens: int = 4096
    """Most image tokens (the model's placeholders for one image, counted after its processor
    ran and before its vision tower does) a request may bring: the vision tower's time and each
    queued request's embeddings grow with them (Qwen2-VL's processor alone allows ~16k)."""
    prepare_timeout: float = 30.0
    """Seconds a request may wait for the preparation slot and be prepared in (parse, image,
    tokens, vision tower; one request at a time) before a 503 ``prepare_timeout``."""
    allow_local_images: str | os.PathLike | None = None
    """A folder: ``image_url`` paths are read under it only (after resolving symlinks and
    ``..``). None: base64 ``data:`` URLs only."""


def _checked(config: ServerConfig) -> ImagePolicy:
    """Refuse a config that would be unsafe or meaningless; return its image policy. Names and
    keys given programmatically get the same checks as the keys file's."""
    if config.api_keys is not None:
        if not isinstance(config.api_keys, dict) or not config.api_keys:
            raise InputError("api_keys must map at least one key to a tenant (None: a keyless loopback server)")
        for key, tenant in config.api_keys.items():
            if not strong_key(key):
                raise InputError(f"the key of tenant {str(tenant)[:64]!r} must be a string of at least "
                                 f"{MIN_KEY_LENGTH} printable ASCII characters without spaces")
            if not valid_tenant_name(tenant):
                raise InputError(f"invalid tenant name {str(tenant)[:64]!r}: letters, digits and '_.-', at most 64, "
                                 "starting with a letter or digit")
        distinct_tenants(list(dict.fromkeys(config.api_keys.values())))
    if isinstance(config.tenant_share, bool) or not isinstance(config.tenant_share, (int, float)) or \
            not 0 < config.tenant_share <= 1:
        raise InputError(f"tenant_share must be a number in (0, 1], got {config.tenant_share!r}")
    if config.max_batch is not None and (isinstance(config.max_batch, bool) or not isinstance(config.max_batch, int)
                                         or config.max_batch < 1):
        raise InputError(f"max_batch must be a positive integer, got {config.max_batch!r}")
    if isinstance(config.prepare_timeout, bool) or not isinstance(config.prepare_timeout, (int, float)) or \
            not config.prepare_timeout > 0:
        raise InputError(f"prepare_timeout must be a positive number of seconds, got {config.prepare_timeout!r}")
    for name in ("max_queue", "max_tokens_limit", "max_body_bytes", "max_image_bytes", "max_image_pixels",
                 "max_image_tokens"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive integer, got {value!r}")
    root = config.allow_local_images
    if root is False:  # the old boolean's default: no local images
        root = None
    if root is True:
        raise InputError("allow_local_images takes the folder local images are read from (it is no longer "
                         "true/false)")
    if root is not None:
        root = Path(root).resolve()
        if not root.is_dir():
            raise InputError(f"allow_local_images: {config.allow_local_images} is not a folder")
    return ImagePolicy(max_bytes=config.max_image_bytes, max_pixels=config.max_image_pixels, local_root=root)


# ----------------------------------------------------------------------------- origin / Host
def _loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _split_authority(authority: str, default_port: int) -> tuple[str, int | None]:
    """``host[:port]`` (IPv6 in brackets) -> (lower-case host, port); port None when malformed
    (user info, a path or spaces are never in a browser's Host or Origin: refused)."""
    if not authority or any(c in authority for c in "@/?#\\ \t"):
        return "", None
    try:  # urlsplit itself raises on a malformed IPv6 literal ("[", "[::1")
        parts = urlsplit(f"//{authority}")
        port = parts.port
    except ValueError:
        return "", None
    return (parts.hostname or ""), (default_port if port is None else port)


class LoopbackGuard:
    """ASGI middleware for a keyless server: answer only requests addressed to this loopback
    server. The Host header must be a loopback name or address with the server's port (a
    DNS-rebinding page's Host is its own name), and a request that carries an Origin (browsers
    send one with every POST and every cross-origin fetch) must come from a loopback origin on
    the same port: the playground page served at ``/`` is one. Anything else: 403."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            reason = self.refusal(scope)
            if reason is not None:
                response = JSONResponse(ApiError(403, reason, type="permission_error", code="forbidden_origin").body(),
                                        status_code=403)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def refusal(scope: Scope) -> str | None:
        server = scope.get("server") or (None, None)
        port = server[1]
        hosts = [v for k, v in scope["headers"] if k == b"host"]
        origins = [v for k, v in scope["headers"] if k == b"origin"]
        if len(hosts) != 1:
            return "this server answers requests to its loopback address only (one Host header)"
        default = 443 if scope.get("scheme") == "https" else 80
        host, host_port = _split_authority(hosts[0].decode("latin-1"), default)
        if not _loopback_host(host) or (port is not None and host_port != port):
            return "this server answers requests addressed to its loopback address only (Host)"
        if len(origins) > 1:
            return "requests from other web origins are refused"
        if origins:
            try:
                origin = urlsplit(origins[0].decode("latin-1"))
            except ValueError:  # "http://[": a malformed IPv6 literal
                return "requests from other web origins are refused"
            if origin.scheme not in ("http", "https") or origin.path or origin.query:
                return "requests from other web origins are refused"
            name, origin_port = _split_authority(origin.netloc, 443 if origin.scheme == "https" else 80)
            if not _loopback_host(name) or (port is not None and origin_port != port):
                return "requests from other web origins are refused"
        return None


# ----------------------------------------------------------------------------- admission
class Admission:
    """Queue slots counted from admission, so reading, parsing, image decoding and tokenising
    are bounded by ``max_queue`` too: a request holds a slot from before its body is read until
    the decoder's queue takes it (engine.depth) or it is refused. And each tenant's share: with
    ``tenant_limit``, a tenant holds at most that many requests at once (from admission until
    its answer or refusal: waiting or decoding), so one key cannot take every slot. `enter` and
    `leave` run on the event loop; `release` also on the decoder's thread."""

    def __init__(self, engine: Engine, max_queue: int, tenant_limit: int | None = None):
        self.engine, self.max_queue, self.tenant_limit = engine, max_queue, tenant_limit
        self.preparing = 0
        self.held: dict[str, int] = {}
        """Requests of each tenant admitted and not yet answered."""
        self._lock = threading.Lock()

    def enter(self, tenant: str) -> str | None:
        """Admit a request of ``tenant`` (None) or say why not: ``queue_full`` or ``tenant_share``."""
        if self.engine.depth + self.preparing >= self.max_queue:
            return "queue_full"
        with self._lock:
            if self.tenant_limit is not None and self.held.get(tenant, 0) >= self.tenant_limit:
                return "tenant_share"
            self.held[tenant] = self.held.get(tenant, 0) + 1
        self.preparing += 1
        return None

    def leave(self) -> None:
        """The request left preparation (submitted to the decoder, or refused)."""
        self.preparing -= 1

    def release(self, tenant: str) -> None:
        """The request was answered or refused: its tenant's share is free again."""
        with self._lock:
            self.held[tenant] -= 1
            if not self.held[tenant]:
                del self.held[tenant]


async def read_body(request: Request, limit: int) -> bytearray:
    """The raw body, cut off as soon as it passes ``limit`` bytes, whether it declares its
    length or streams chunked: a 413 without holding more than ``limit`` + one chunk."""
    declared = request.headers.get("content-length")
    if declared is not None and not (declared.isascii() and declared.isdigit() and len(declared) <= 19):
        raise ApiError(400, "the Content-Length header is not a number")
    too_large = ApiError(413, f"the request is larger than {limit} bytes", type="request_too_large",
                         code="request_too_large")
    if declared is not None and int(declared) > limit:
        raise too_large
    body = bytearray()
    try:
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected while sending the request") from None
    return body


def _json_content_type(request: Request) -> bool:
    """``application/json`` (with any parameters): a cross-site HTML form or a no-preflight
    fetch cannot send it, so it is the second line behind `LoopbackGuard`."""
    value = request.headers.get("content-type", "")
    return value.split(";", 1)[0].strip().lower() == "application/json"


# ----------------------------------------------------------------------------- the app
def create_app(target: TargetModel, config: ServerConfig, make_engine: Callable[..., Any] | None = None) -> FastAPI:
    """The server's app. ``make_engine(on_finish=...)``: the decoder instead of a local `Engine`
    (``recap serve --replicas``: `recap.serve.scale.ScaledEngine`, which keeps the memories
    itself); the target then only prepares requests (templates, images, tokens)."""
    images = _checked(config)
    max_prompt_chars = _longest_token(target) * target.max_context
    tenants = TenantStreams(config.method, target.vocab_size, config.memory_dir, config.memory_rows) \
        if make_engine is None else None
    metrics = Metrics(lambda: engine.depth)  # read at scrape time, once the engine exists
    if tenants is not None:
        tenants.saver.on_coalesced = metrics.memory_saves_coalesced.inc
    secrets = _server_paths(target, config, images)

    def redact(message: str) -> str:
        """Server paths (the model folder, the memory and image folders, home) never leave."""
        for path, name in secrets:
            message = message.replace(path, name)
        return message

    def on_finish(job: Job, event: dict) -> None:
        admission.release(job.tenant)
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
            metrics.abandoned_tokens.inc(event.get("completion_tokens", 0))

    if make_engine is None:
        engine = Engine(target, tenants, max_queue=config.max_queue, max_batch=config.max_batch,
                        shared_budget=config.shared_budget, on_finish=on_finish)
    else:
        engine = make_engine(on_finish=on_finish)
    admission = Admission(engine, config.max_queue, _tenant_limit(config, engine))
    preparing = asyncio.Semaphore(1)  # one JSON parse / image decode / tokenisation at a time: memory is bounded

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await run_in_threadpool(engine.shutdown)
        log.info("memories saved; bye")

    app = FastAPI(title="RECAP", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.tenants, app.state.metrics = engine, tenants, metrics
    app.state.admission = admission
    if config.api_keys is None:
        app.add_middleware(LoopbackGuard)

    # ------------------------------------------------------------------ errors
    def error_response(error: ApiError) -> JSONResponse:
        error.message = redact(error.message)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return error_response(ApiError(error.status_code, str(error.detail), code=code))

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
                "busy": engine.busy, "running": len(engine.batch.running), "max_batch": engine.batch.max_batch,
                **(engine.health() if hasattr(engine, "health") else {})}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        tenant_of(request)
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "recap"}]}

    # ------------------------------------------------------------------ chat completions
    def prepare(raw: bytearray) -> tuple[ChatRequest, ModelInputs]:
        """Parse, check the model name, then decode the image, tokenise and run the vision tower
        (in a worker thread, so the decoding thread only prefills the language rows)."""
        chat = parse_chat_request(parse_json_body(raw))
        if chat.model != config.model_name:
            raise ApiError(404, f"model {chat.model[:64]!r} is not served here; this server serves "
                                f"{config.model_name!r}", code="model_not_found")
        if chat.image_url is not None:
            check_image_url(chat.image_url, images)
        if chat.image_url is not None and not target.accepts_images:
            raise ApiError(400, f"{config.model_name} is a text-only model: it cannot take an image",
                           code="image_not_supported")
        if len(chat.messages) >= target.max_context:  # each message is at least one token
            raise ApiError(400, f"{len(chat.messages)} messages cannot fit the model's context of "
                                f"{target.max_context} tokens", code="context_length_exceeded")
        chars = sum(len(m["content"]) for m in chat.messages)
        if chars > max_prompt_chars:  # tokenising 16 MB of text took 20 s and 2 GB to find out
            raise ApiError(400, f"the messages hold {chars} characters, more than the model's context of "
                                f"{target.max_context} tokens can hold", code="context_length_exceeded")
        image = read_image_url(chat.image_url, images) if chat.image_url is not None else None
        try:
            inputs = target.prepare(chat.messages, image)
            if image is not None:  # before the vision tower runs: it is what costs
                count = int(np.isin(inputs.input_ids[0].numpy(), list(target.excluded_tokens)).sum())
                if count > config.max_image_tokens:
                    raise ApiError(400, f"the image becomes {count} image tokens for {config.model_name}, more than "
                                        f"this server's limit of {config.max_image_tokens}; send a smaller image",
                                   code="image_too_large")
            return chat, target.encode_images(inputs)
        except ApiError:
            raise
        except InputError as error:
            raise ApiError(400, str(error)) from None
        except TemplateError as error:  # the model's chat template refuses the messages (roles, order)
            raise ApiError(400, f"{config.model_name}'s chat template refuses these messages: {str(error)[:200]}",
                           code="invalid_messages") from None
        except Exception:
            if image is None:
                raise
            # the model's processor refuses some shapes (an aspect ratio past 200:1, ...)
            log.warning("the processor refused an image of %dx%d", image.width, image.height, exc_info=True)
            raise ApiError(400, f"{config.model_name}'s image processor cannot take this image "
                                f"({image.width}x{image.height})", code="invalid_image") from None

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrived = time.monotonic()
        deadline = arrived + config.request_timeout
        tenant = tenant_of(request)
        if not _json_content_type(request):
            raise ApiError(415, "the request body must be JSON (Content-Type: application/json)",
                           code="unsupported_media_type")
        refused = admission.enter(tenant)
        if refused == "tenant_share":
            raise ApiError(429, f"this key already has {admission.tenant_limit} requests in the server, its share; "
                                "retry when one is answered", type="rate_limit_error", code="tenant_share_exceeded",
                           headers={"Retry-After": "1"})
        if refused is not None:
            raise ApiError(429, "the server is busy: its queue is full; retry later", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"})
        submitted = False
        try:
            reading = asyncio.ensure_future(read_body(request, config.max_body_bytes))
            body_deadline = max(deadline, arrived + MIN_BODY_SECONDS)
            try:
                done, _ = await asyncio.wait({reading}, timeout=max(0.0, body_deadline - time.monotonic()))
            finally:
                if not reading.done():
                    reading.cancel()
            if not done:
                raise ApiError(408, "the request body did not arrive within the server's time limit",
                               code="request_timeout")
            raw = reading.result()
            chat, inputs = await _prepared(request, raw, preparing, prepare, deadline,
                                           time.monotonic() + config.prepare_timeout)
            del raw
            prompt_len = inputs.input_ids.shape[1]
            limit, what = target.max_context, "context"
            window = target.sliding_window
            if window is not None and window < limit:  # past it tree verification is not exact
                limit, what = window, "sliding attention window"
            room = limit - prompt_len
            if room < 1:
                raise ApiError(400, f"the prompt ({prompt_len} tokens) fills the model's {what} of {limit} tokens",
                               code="context_length_exceeded")
            max_tokens = chat.max_tokens if chat.max_tokens is not None else min(config.max_tokens_limit, room)
            if max_tokens > config.max_tokens_limit:
                raise ApiError(400, f"max_tokens {max_tokens} is above this server's limit of "
                                    f"{config.max_tokens_limit}", code="max_tokens_too_large")
            if max_tokens > room:
                raise ApiError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                                    f"{what} of {limit} tokens", code="context_length_exceeded")

            loop = asyncio.get_running_loop()
            events: asyncio.Queue[dict] = asyncio.Queue()
            job = Job(tenant=tenant, inputs=inputs, max_tokens=max_tokens, sampling=chat.sampling,
                      streamed=chat.stream, stop=chat.stop,
                      emit=lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
                      deadline=deadline, submitted=arrived)
            try:
                engine.submit(job)
                submitted = True
            except Unavailable as error:
                raise ApiError(503, str(error), type="server_error", code=error.code) from None
            except QueueFull as error:
                raise ApiError(429, f"the server is busy: {error}; retry later", type="rate_limit_error",
                               code="queue_full", headers={"Retry-After": "1"}) from None
        finally:
            admission.leave()  # the job now counts in engine.depth, or was refused
            if not submitted:
                admission.release(tenant)
        request_id = completion_id()
        if chat.stream:
            return StreamingResponse(_stream(request_id, job, events, chat.include_usage, arrived),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _collect(request, request_id, job, events)

    async def _collect(request: Request, request_id: str, job: Job, events: asyncio.Queue) -> JSONResponse:
        watcher = asyncio.ensure_future(_cancel_on_disconnect(request, job))
        try:
            while True:
                event = await events.get()
                if event["type"] == "done":
                    return JSONResponse(completion(request_id, config.model_name, event["text"],
                                                   event["stop_reason"], event["usage"], event["recap"]))
                if event["type"] == "error":
                    raise ApiError(event.get("status", 500), redact(event["message"]), code=event.get("code"),
                                   type="server_error" if event.get("status", 500) >= 500 else "request_error")
        finally:
            watcher.cancel()
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
                    yield _sse(ApiError(status, redact(event["message"]), code=event.get("code"),
                                        type="server_error" if status >= 500 else "request_error").body())
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()  # the client went away mid-stream: the decoder stops at its next step

    return app


def _tenant_limit(config: ServerConfig, engine: Any) -> int | None:
    """Requests one tenant may hold at once: ``tenant_share`` of the queue and the batch's
    lanes together, where the server has several tenants (None: no limit)."""
    tenants = set((config.api_keys or {}).values())
    if len(tenants) < 2 or config.tenant_share >= 1:
        return None
    lanes = getattr(engine, "max_batch", None) or engine.batch.max_batch
    return max(1, int(config.tenant_share * (config.max_queue + lanes)))


class ClientGone(ApiError):
    """The client hung up before its request was prepared: nothing is prepared or queued for it
    (the 499 answer reaches no one)."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the connection", code="client_closed_request")


async def _prepared(request: Request, raw: bytearray, preparing: asyncio.Semaphore,
                    prepare: Callable[[bytearray], Any], deadline: float, prepare_deadline: float) -> Any:
    """``prepare(raw)`` in a worker thread, one request at a time (``preparing``), watching the
    client meanwhile: a client that hangs up while its request waits for the preparation slot
    is dropped without any work (`ClientGone`), one that hung up during its preparation is not
    queued. Past ``prepare_deadline`` (``prepare_timeout`` after its body arrived) the request
    gets 503 ``prepare_timeout``, past ``deadline`` (the request's own) 504; a preparation
    already running finishes in its thread, its result dropped, and only then lets the next
    one in: memory stays bounded."""
    gone = asyncio.Event()

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone.set()

    started = False

    async def run() -> Any:
        nonlocal started
        async with preparing:
            if gone.is_set():
                raise ClientGone
            started = True
            return await run_in_threadpool(prepare, raw)

    watcher, work = asyncio.ensure_future(watch()), asyncio.ensure_future(run())
    goodbye = asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait({work, goodbye}, timeout=max(0.0, min(deadline, prepare_deadline) - time.monotonic()),
                           return_when=asyncio.FIRST_COMPLETED)
        if gone.is_set():
            raise ClientGone
        if not work.done() and time.monotonic() >= deadline:
            raise ApiError(504, "the request ran past the server's time limit before it was prepared",
                           type="server_error", code="request_timeout")
        if not work.done():
            raise ApiError(503, "the request could not be prepared (parsed, its image read, tokenised) within the "
                                "server's time limit; retry later", type="server_error", code="prepare_timeout",
                           headers={"Retry-After": "1"})
        return work.result()
    finally:
        for task in (watcher, goodbye):
            task.cancel()
        if not work.done() and not started:
            work.cancel()  # still waiting for the slot: it leaves the line
        elif not work.done():  # preparing: it keeps the slot until its thread is done, its result dropped
            work.add_done_callback(lambda task: task.cancelled() or task.exception())


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    """Cancel ``job`` as soon as its client hangs up: the server's next ASGI message for a
    request whose body was read is the disconnect (uvicorn sends it when the connection
    closes, or once the response is complete: the job is done then, and cancelling it is a
    no-op). A non-streamed request sees no write fail, so without this it would decode to
    its end for no one."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


def _longest_token(target: TargetModel) -> int:
    """The most characters one token can stand for: its vocabulary's longest entry (a piece
    never decodes to more characters than it has: byte-level pieces spell one byte per
    character, sentencepiece ones their text). A prompt of more characters than this times
    the context cannot fit, and is refused before it is tokenised."""
    return max(len(piece) for piece in target.tokenizer.get_vocab())


def _server_paths(target: TargetModel, config: ServerConfig, images: ImagePolicy) -> list[tuple[str, str]]:
    """(absolute path, what to say instead) for every server path an error could carry,
    longest first so a folder inside another is replaced whole."""
    paths = {str(target.name): config.model_name, str(Path.home()): "~", os.getcwd(): "."}
    if config.memory_dir is not None:
        paths[str(Path(config.memory_dir).resolve())] = "<memory folder>"
        paths[str(config.memory_dir)] = "<memory folder>"
    if images.local_root is not None:
        paths[str(images.local_root)] = "<image folder>"
    return sorted(((p, n) for p, n in paths.items() if len(p) > 1 and os.sep in p), key=lambda pn: -len(pn[0]))


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
