"""OpenAI chat-completions requests in, RECAP prompts out; responses and stream chunks back.

Only what RECAP can honour is accepted: greedy decoding (temperature 0 or absent) or lossless
sampling (``temperature`` > 0 with ``top_p``, the extra ``top_k`` and ``seed``), one answer
(``n`` = 1), at most one image, given as a base64 ``data:`` URL (or a local path when the
server allows it). Anything else is an `ApiError` with the OpenAI error shape, never a
traceback.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from PIL import Image, UnidentifiedImageError

from recap.target.sampling import Sampling, SamplingError

MAX_IMAGE_BYTES = 10 * 1024 * 1024
MAX_IMAGE_PIXELS = 40_000_000


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


@dataclass
class ChatRequest:
    """A validated request: text-only chat messages plus at most one image."""

    messages: list[dict[str, str]]
    image: Image.Image | None
    max_tokens: int | None
    sampling: Sampling | None = None
    """None: greedy."""
    stream: bool = False
    include_usage: bool = False
    model: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def parse_chat_request(body: Any, *, allow_local_images: bool = False) -> ChatRequest:
    """Check an OpenAI chat-completions body; raise `ApiError` (400/413) with the reason."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", code="invalid_messages")
    temperature = body.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                    or temperature < 0):
        raise ApiError(400, "'temperature' must be a number >= 0")
    try:
        sampling = Sampling.of(temperature, body.get("top_k"), body.get("top_p"), body.get("seed"))
    except SamplingError as error:
        raise ApiError(400, str(error), code="invalid_sampling") from None
    if body.get("seed") is not None and (isinstance(body["seed"], bool) or not isinstance(body["seed"], int)):
        raise ApiError(400, "'seed' must be an integer")
    if body.get("n", 1) != 1:
        raise ApiError(400, "'n' must be 1: one answer per request", code="unsupported_parameter")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ApiError(400, "'max_tokens' / 'max_completion_tokens' must be a positive integer")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object")
    texts, image = [], None
    for message in messages:
        role, parts = _message_parts(message)
        text = []
        for part in parts:
            if part.get("type") == "text":
                if not isinstance(part.get("text"), str):
                    raise ApiError(400, "a text part needs a string 'text'")
                text.append(part["text"])
            elif part.get("type") == "image_url":
                if image is not None:
                    raise ApiError(400, "one image per request is supported", code="too_many_images")
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                image = read_image_url(url, allow_local_images=allow_local_images)
            else:
                raise ApiError(400, f"unsupported content part type {part.get('type')!r} (text and image_url are)")
        texts.append({"role": role, "content": "".join(text)})
    if not any(m["content"].strip() for m in texts) and image is None:
        raise ApiError(400, "the messages contain no text", code="invalid_messages")
    return ChatRequest(messages=texts, image=image, max_tokens=max_tokens, sampling=sampling, stream=stream,
                       include_usage=bool(options.get("include_usage", False)), model=str(body.get("model", "")))


def _message_parts(message: Any) -> tuple[str, list[dict]]:
    if not isinstance(message, dict):
        raise ApiError(400, "each message must be an object with 'role' and 'content'", code="invalid_messages")
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant"):
        raise ApiError(400, f"unsupported message role {role!r}", code="invalid_messages")
    content = message.get("content")
    if isinstance(content, str):
        return ("system" if role == "developer" else role), [{"type": "text", "text": content}]
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return ("system" if role == "developer" else role), content
    raise ApiError(400, "'content' must be a string or a list of parts", code="invalid_messages")


def read_image_url(url: Any, *, allow_local_images: bool) -> Image.Image:
    """A ``data:image/...;base64,`` URL, or a local path (``file://`` or plain) when allowed.
    The server never fetches from the network."""
    if not isinstance(url, str) or not url:
        raise ApiError(400, "an image_url part needs a 'url'")
    if url.startswith(("http://", "https://")):
        raise ApiError(400, "images must be sent inline as base64 data: URLs; this server does not fetch URLs",
                       code="image_url_not_supported")
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if ";base64" not in header:
            raise ApiError(400, "a data: URL image must be base64-encoded")
        if len(payload) * 3 // 4 > MAX_IMAGE_BYTES:
            raise ApiError(413, f"the image is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MiB",
                           type="request_too_large", code="image_too_large")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "the image's base64 data cannot be decoded", code="invalid_image") from None
        return _open_image(io.BytesIO(data), "the image")
    if not allow_local_images:
        raise ApiError(400, "local image paths are refused (start the server with --allow-local-images)",
                       code="image_url_not_supported")
    path = url.removeprefix("file://")
    if not os.path.isfile(path):
        raise ApiError(400, f"image not found: {path}", code="invalid_image")
    if os.path.getsize(path) > MAX_IMAGE_BYTES:
        raise ApiError(413, f"the image is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MiB",
                       type="request_too_large", code="image_too_large")
    return _open_image(path, path)


def _open_image(source, name: str) -> Image.Image:
    try:
        with Image.open(source) as image:
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise ApiError(413, f"{name} has more than {MAX_IMAGE_PIXELS} pixels", type="request_too_large",
                               code="image_too_large")
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        raise ApiError(400, f"{name} is not a readable image", code="invalid_image") from None


# ----------------------------------------------------------------------------- responses
def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


def finish_reason(stop_reason: str) -> str:
    return "stop" if stop_reason == "eos" else "length"


def completion(request_id: str, model: str, text: str, stop_reason: str, usage: dict, recap: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish_reason(stop_reason)}],
            "usage": usage, "recap": recap}


def chunk(request_id: str, model: str, delta: dict, finish: str | None = None, **extra) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
