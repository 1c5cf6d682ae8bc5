"""OpenAI chat-completions requests in, RECAP prompts out; responses and stream chunks back.

Only what RECAP can honour is accepted: greedy decoding (temperature 0 or absent) or lossless
sampling (``temperature`` > 0 with ``top_p``, the extra ``top_k`` and ``seed``), one answer
(``n`` = 1), at most one image, given as a base64 ``data:`` URL (or a path under the server's
image folder when it has one). Anything else is an `ApiError` with the OpenAI error shape,
never a traceback.

Parsing is in two steps so the server can refuse cheaply first: `parse_json_body` and
`parse_chat_request` check the body's shape and every field's type without decoding any
image; `read_image_url` decodes the image afterwards, once the request is admitted and names
the served model. Every limit here is a parameter or a named constant (see docs/security.md).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
import math
import os
import stat
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from recap.verifier.sampling import Sampling, SamplingError

log = logging.getLogger("recap.serve")

MAX_IMAGE_BYTES = 10 * 1024 * 1024
MAX_IMAGE_PIXELS = 40_000_000
MAX_JSON_DEPTH = 32
"""Deepest nesting of JSON arrays and objects accepted (a chat body needs 6)."""
MAX_INT_DIGITS = 20
"""Longest integer literal accepted: int64 fits, ``10**400`` does not reach Python's int()."""
MAX_SEED = 2**63 - 1
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""Formats Pillow may open: OpenAI's four plus BMP, never plugins that run other programs (EPS)."""


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


@dataclass(frozen=True)
class ImagePolicy:
    """Where an image may come from and how large it may be: the server's options."""

    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS
    local_root: Path | None = None
    """An absolute, resolved folder: local paths are read under it only. None: no local paths."""


@dataclass
class ChatRequest:
    """A validated request: text-only chat messages plus at most one image URL (not yet read)."""

    messages: list[dict[str, str]]
    image_url: str | None
    max_tokens: int | None
    sampling: Sampling | None = None
    """None: greedy."""
    stream: bool = False
    include_usage: bool = False
    model: str = ""
    stop: tuple[str, ...] = ()
    """Strings that end the answer where one first appears (not included)."""
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- JSON
class _Refused(ValueError):
    """Raised from inside json.loads' hooks to stop parsing a value we will not accept."""


def _parse_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"a number in the request has more than {MAX_INT_DIGITS} digits")
    return int(literal)


def _parse_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _Refused("a number in the request is out of range")
    return value


def _parse_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def parse_json_body(raw: bytes | bytearray, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The request's JSON, parsed defensively: UTF-8 only, no NaN/Infinity, no integer longer
    than `MAX_INT_DIGITS` digits (Python would spend quadratic time or raise a ValueError the
    caller did not expect), nesting at most ``max_depth`` deep. Anything else: a 400."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not UTF-8 text", code="invalid_json") from None
    # the bracket count bounds the depth; only a body that could be too deep is walked
    could_be_deep = text.count("[") + text.count("{") > max_depth
    try:
        body = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except _Refused as error:
        raise ApiError(400, str(error), code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, f"the request's JSON is nested more than {max_depth} levels deep",
                       code="invalid_json") from None
    except ValueError:  # json.JSONDecodeError and int() refusals
        raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
    if could_be_deep and _depth_over(body, max_depth):
        raise ApiError(400, f"the request's JSON is nested more than {max_depth} levels deep", code="invalid_json")
    return body


def _depth_over(value: Any, limit: int) -> bool:
    """Whether ``value`` nests containers more than ``limit`` deep (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


# ----------------------------------------------------------------------------- fields
def _echo(value: Any, limit: int = 40) -> str:
    """A short repr of a client's value for an error message (never the whole of a huge one)."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ApiError(400, f"{what} must be a string, got {_echo(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a "\\ud800" escape
        raise ApiError(400, f"{what} is not valid Unicode text (a lone surrogate)") from None
    return value


def _optional_bool(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {_echo(value)}")
    return value


def _sampling(body: dict) -> Sampling | None:
    """Every sampling field is type-checked even when greedy ignores it: a wrong type is a
    client bug worth reporting, whatever the temperature."""
    temperature, top_k, top_p, seed = (body.get(k) for k in ("temperature", "top_k", "top_p", "seed"))
    if temperature is not None and (not _is_number(temperature) or temperature < 0):
        raise ApiError(400, "'temperature' must be a number >= 0", code="invalid_sampling")
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        raise ApiError(400, "'top_k' must be a whole number >= 0", code="invalid_sampling")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise ApiError(400, "'top_p' must be a number in (0, 1]", code="invalid_sampling")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise ApiError(400, f"'seed' must be a whole number in [0, {MAX_SEED}]", code="invalid_sampling")
    try:
        return Sampling.of(temperature, top_k, top_p, seed)
    except SamplingError as error:
        raise ApiError(400, str(error), code="invalid_sampling") from None


UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
}
"""Fields that would change the answer, with the values that change nothing: any other value
is refused (400 ``unsupported_parameter``) rather than silently ignored, so a client never
reads an answer as if its penalties or tools had been applied. Fields that
change nothing here (``user``, ``metadata``, ``store``, ...) are accepted and ignored."""


MAX_STOPS = 4
MAX_STOP_CHARS = 256


def _stop(body: dict) -> tuple[str, ...]:
    """OpenAI's ``stop``: a string or up to 4 strings (none empty); None or [] for none."""
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or \
            not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOPS} non-empty strings of "
                            f"at most {MAX_STOP_CHARS} characters", code="invalid_stop")
    return tuple(dict.fromkeys(stops))


def _refuse_unsupported(body: dict) -> None:
    for name, neutral in UNSUPPORTED_FIELDS.items():
        value = body.get(name)
        if not any(type(value) is type(ok) and value == ok for ok in neutral) and \
                not (value is None and None in neutral):
            raise ApiError(400, f"'{name}' is not supported by this server (it would change the answer)",
                           code="unsupported_parameter")


def parse_chat_request(body: Any) -> ChatRequest:
    """Check an OpenAI chat-completions body's shape and fields; raise `ApiError` (400) with the
    reason. The image, if any, is only located here (`ChatRequest.image_url`), not read."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "'model' must be a string naming the served model", code="invalid_model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", code="invalid_messages")
    _refuse_unsupported(body)
    sampling = _sampling(body)
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise ApiError(400, "'n' must be 1: one answer per request", code="unsupported_parameter")
    for name in ("max_tokens", "max_completion_tokens"):  # both checked, though the second wins
        value = body.get(name)
        if value is not None and (not _is_int(value) or value < 1):
            raise ApiError(400, f"'{name}' must be a positive integer")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    stream = _optional_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object")
    include_usage = _optional_bool(options or {}, "include_usage")
    texts, image_url = [], None
    for message in messages:
        role, parts = _message_parts(message)
        text = []
        for part in parts:
            kind = part.get("type")
            if kind == "text":
                text.append(_text(part.get("text"), "a text part's 'text'"))
            elif kind == "image_url":
                if image_url is not None:
                    raise ApiError(400, "one image per request is supported", code="too_many_images")
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url:
                    raise ApiError(400, "an image_url part needs a 'url' string")
                image_url = url
            else:
                raise ApiError(400, f"unsupported content part type {_echo(kind)} (text and image_url are)")
        texts.append({"role": role, "content": "".join(text)})
    if not any(m["content"].strip() for m in texts) and image_url is None:
        raise ApiError(400, "the messages contain no text", code="invalid_messages")
    if image_url is not None and not any(m["role"] == "user" for m in texts):  # it goes in the first user turn
        raise ApiError(400, "an image needs a user message to go in", code="invalid_messages")
    return ChatRequest(messages=texts, image_url=image_url, max_tokens=max_tokens, sampling=sampling, stream=stream,
                       include_usage=include_usage, model=model, stop=_stop(body))


def _message_parts(message: Any) -> tuple[str, list[dict]]:
    if not isinstance(message, dict):
        raise ApiError(400, "each message must be an object with 'role' and 'content'", code="invalid_messages")
    role = message.get("role")
    if not isinstance(role, str) or role not in ("system", "developer", "user", "assistant"):
        raise ApiError(400, f"unsupported message role {_echo(role)}", code="invalid_messages")
    role = "system" if role == "developer" else role
    content = message.get("content")
    if isinstance(content, str):
        return role, [{"type": "text", "text": _text(content, "'content'")}]
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return role, content
    raise ApiError(400, "'content' must be a string or a list of parts", code="invalid_messages")


# ----------------------------------------------------------------------------- images
def _size(n: int) -> str:
    return f"{n // (1024 * 1024)} MiB" if n % (1024 * 1024) == 0 else f"{n} bytes"


def _too_large(policy: ImagePolicy) -> ApiError:
    return ApiError(413, f"the image is larger than {_size(policy.max_bytes)}", type="request_too_large",
                    code="image_too_large")


IMAGE_NOT_FOUND = "image not found (a local image must be a file under the server's image folder)"
"""The one answer for a path outside the folder, a missing file, a folder or a special file:
a client learns nothing about the machine beyond the folder it was given."""


def check_image_url(url: str, policy: ImagePolicy) -> None:
    """The checks on an image URL that read nothing: its scheme, and a data: URL's size."""
    if url.startswith(("http://", "https://")):
        raise ApiError(400, "images must be sent inline as base64 data: URLs; this server does not fetch URLs",
                       code="image_url_not_supported")
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if ";base64" not in header:
            raise ApiError(400, "a data: URL image must be base64-encoded", code="invalid_image")
        if len(payload) * 3 // 4 > policy.max_bytes:  # refused before decoding a byte
            raise _too_large(policy)
    elif policy.local_root is None:
        raise ApiError(400, "local image paths are refused (start the server with --allow-local-images DIR)",
                       code="image_url_not_supported")


def read_image_url(url: str, policy: ImagePolicy) -> Image.Image:
    """A ``data:image/...;base64,`` URL, or a path (``file://`` or plain; relative ones from the
    image folder) under ``policy.local_root``. The server never fetches from the network."""
    check_image_url(url, policy)
    if url.startswith("data:"):
        try:
            data = base64.b64decode(url.partition(",")[2], validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "the image's base64 data cannot be decoded", code="invalid_image") from None
        return _open_image(data, policy)
    return _open_image(_read_local(url, policy), policy)


def _read_local(url: str, policy: ImagePolicy) -> bytes:
    """The bytes of a regular file under the image folder, after resolving ``..`` and symlinks;
    anything else is `IMAGE_NOT_FOUND`, so existence and size outside it never show."""
    root = policy.local_root
    assert root is not None
    missing = ApiError(400, IMAGE_NOT_FOUND, code="invalid_image")
    try:
        resolved = (root / url.removeprefix("file://")).resolve(strict=True)
    except (OSError, RuntimeError, ValueError):  # missing, a symlink loop, a NUL byte
        raise missing from None
    if not resolved.is_relative_to(root):
        raise missing
    try:  # O_NOFOLLOW / O_NONBLOCK: a swapped-in symlink or a FIFO cannot redirect or hang the read
        fd = os.open(resolved, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        raise missing from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # a folder, a device, a FIFO
            raise missing
        if info.st_size > policy.max_bytes:
            raise _too_large(policy)
        with os.fdopen(os.dup(fd), "rb") as file:
            data = file.read(policy.max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > policy.max_bytes:  # grew since fstat
        raise _too_large(policy)
    return data


def _open_image(data: bytes, policy: ImagePolicy) -> Image.Image:
    """Decode to RGB, refusing before decoding when the header declares too many pixels."""
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            if image.width * image.height > policy.max_pixels:
                raise ApiError(413, f"the image has more than {policy.max_pixels} pixels", type="request_too_large",
                               code="image_too_large")
            return image.convert("RGB")
    except ApiError:
        raise
    except Exception as error:  # noqa: BLE001 - Pillow's plugins raise many kinds on hostile bytes
        log.debug("an image could not be decoded: %r", error)
        raise ApiError(400, f"the image is not a readable image ({', '.join(IMAGE_FORMATS)} are)",
                       code="invalid_image") from None


# ----------------------------------------------------------------------------- responses
def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


def finish_reason(stop_reason: str) -> str:
    return "stop" if stop_reason in ("eos", "stop") else "length"


def completion(request_id: str, model: str, text: str, stop_reason: str, usage: dict, recap: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish_reason(stop_reason)}],
            "usage": usage, "recap": recap}


def chunk(request_id: str, model: str, delta: dict, finish: str | None = None, **extra) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
