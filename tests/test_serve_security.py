"""`recap serve` under hostile input: admission before work, bounded memory, origins, paths.

Real uvicorn servers on 127.0.0.1 (free ports, in this process so the tests can look at the
app's state and count what it decodes). Each test names the old behaviour it would have
caught: no limit here holds only because a request happened to be polite.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import socket
import threading
import time
import tracemalloc
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from recap.core.persistence import read_token_memory
from recap.errors import InputError
from recap.images import synthetic_image
from recap.serve import ServerConfig, create_app
from recap.serve.chat import IMAGE_NOT_FOUND
from recap.serve.tenants import TenantStreams, read_api_keys, tenant_for
from tests.conftest import load_target
from tests.test_serve import _data_url, serving

CHAT = "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}
HI = [{"role": "user", "content": "hi"}]
CLASS_NAME = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception)\b")


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _post(url: str, body=None, *, raw: bytes | str | None = None, headers: dict | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(url + CHAT, content=content, headers={**JSON, **(headers or {})}, timeout=120)


def _error(response: httpx.Response, status: int) -> dict:
    """The OpenAI-shaped error of ``response``, which must have ``status``."""
    assert response.status_code == status, (response.status_code, response.text[:300])
    assert "Traceback" not in response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str) and "code" in error
    return error


def _no_internals(message: str, *paths: str) -> None:
    assert not CLASS_NAME.search(message), message
    for path in (str(Path.home()), *paths):
        assert path not in message, message


def _until(condition, what: str) -> None:
    """Wait for server state another thread changes (bounded, so a bug fails instead of hanging)."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


# ----------------------------------------------------------------------------- the fuzz test
def _png_url(width: int, height: int) -> str:
    return _data_url(Image.new("RGB", (width, height), (width % 256, height % 256, 90)))


JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12))
JSON_ANY = st.recursive(JSON_LEAF, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
IMAGE_URLS = st.one_of(
    st.builds(_png_url, st.integers(1, 48), st.integers(1, 48)),
    st.sampled_from([_png_url(300, 1), _png_url(1, 250), "data:image/png;base64,bm90IGFuIGltYWdl",
                     "data:image/png;base64,@@@@", "data:image/png,plain", "data:;base64,", "https://example.com/a.png",
                     "file:///etc/passwd", "/etc/passwd", "../outside.png", "inside.png", "link.png", "sub",
                     "file://inside.png", "inside.png\x00x", "x" * 5000]),
    st.text(max_size=20))
PARTS = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=40)}),
    st.fixed_dictionaries({"type": st.just("image_url"),
                           "image_url": st.one_of(st.fixed_dictionaries({"url": IMAGE_URLS}), IMAGE_URLS, JSON_ANY)}),
    st.dictionaries(st.sampled_from(["type", "text", "image_url"]), JSON_ANY, max_size=3))
MESSAGES = st.one_of(
    st.lists(st.fixed_dictionaries({
        "role": st.one_of(st.sampled_from(["user", "user", "system", "assistant", "developer", "tool"]), JSON_ANY),
        "content": st.one_of(st.text(max_size=60), st.lists(PARTS, max_size=3), JSON_ANY)}), max_size=3),
    JSON_ANY)
SMALL_INTS = st.one_of(st.integers(-3, 6), JSON_ANY)
BODIES = st.fixed_dictionaries(
    {"model": st.one_of(st.just("tiny-qwen2.5-vl"), st.just("tiny-qwen2.5-vl"), JSON_ANY), "messages": MESSAGES},
    optional={"max_tokens": SMALL_INTS, "max_completion_tokens": SMALL_INTS, "n": SMALL_INTS,
              "temperature": st.one_of(st.floats(-1, 3), JSON_ANY), "top_p": st.one_of(st.floats(-1, 2), JSON_ANY),
              "top_k": st.one_of(st.integers(-2, 10**20), JSON_ANY),
              "seed": st.one_of(st.integers(-(2**65), 2**65), JSON_ANY), "stream": st.one_of(st.booleans(), JSON_ANY),
              "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), JSON_ANY),
              "stop": JSON_ANY, "extra": JSON_ANY})
GOOD_PARTS = st.one_of(
    st.text(min_size=1, max_size=40),
    st.tuples(st.one_of(st.builds(_png_url, st.integers(1, 40), st.integers(1, 40)),
                        st.sampled_from([_png_url(300, 1), _png_url(1, 250)])),  # past Qwen's 200:1 aspect ratio
              st.text(max_size=20)).map(
        lambda pair: [{"type": "image_url", "image_url": {"url": pair[0]}}, {"type": "text", "text": pair[1]}]))
GOOD_BODIES = st.fixed_dictionaries(
    {"model": st.just("tiny-qwen2.5-vl"),
     "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                 "content": GOOD_PARTS}), min_size=1, max_size=2)},
    optional={"max_tokens": st.integers(1, 4), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
              "top_k": st.integers(0, 50), "seed": st.integers(0, 2**63 - 1), "stream": st.booleans(),
              "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})})
PAYLOADS = st.one_of(
    GOOD_BODIES.map(json.dumps), GOOD_BODIES.map(json.dumps), GOOD_BODIES.map(json.dumps),  # decoded: answers
    BODIES.map(json.dumps), BODIES.map(json.dumps), BODIES.map(json.dumps),  # near-valid: every field's checks
    JSON_ANY.map(json.dumps), st.binary(max_size=40),
    st.integers(1, 200_000).map(lambda depth: "[" * depth + "]" * depth),
    st.integers(1, 6000).map(lambda digits: '{"model": "tiny-qwen2.5-vl", "messages": [{"role": "user", '
                                            '"content": "hi"}], "max_tokens": ' + "7" * digits + "}"),
    st.sampled_from(['{"messages": [{"role": "user", "content": "\\ud800"}], "model": "tiny-qwen2.5-vl"}',
                     '{"model": "tiny-qwen2.5-vl", "messages": [{"role": "user", "content": "hi"}], '
                     '"temperature": 1e999}', '{"model": NaN}', "\ufeff{}", "{" * 40 + "}" * 40]))
HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=24).map(str.strip)
"""Printable ASCII without edge spaces: what an HTTP client lets through (httpx refuses the rest)."""


FUZZ_KEY = "key-of-the-fuzzer-01"


def _requests(port: int):
    own = f"http://127.0.0.1:{port}"
    return st.fixed_dictionaries({
        "route": st.sampled_from([("POST", CHAT)] * 12 + [("GET", "/v1/models"), ("GET", "/health"),
                                                          ("POST", "/v1/models"), ("GET", "/nowhere"), ("GET", "/")]),
        "payload": PAYLOADS,
        "content_type": st.sampled_from(["application/json"] * 12 + [
            "application/json; charset=utf-8", "Application/JSON", "text/plain", "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x", None]),
        "origin": st.sampled_from([None] * 12 + [own, f"http://localhost:{port}", "http://evil.example", "null",
                                   f"http://127.0.0.1:{port + 1}", f"http://[::1]:{port}", "file://"]),
        "host": st.sampled_from([None] * 12 + [f"localhost:{port}", "evil.example", f"evil.example:{port}",
                                 f"127.0.0.1:{port + 1}", f"[::1]:{port}", "127.0.0.1", f"127.0.0.1:{port}x"]),
        "authorization": st.one_of(
            st.just(f"Bearer {FUZZ_KEY}"), st.just(f"Bearer {FUZZ_KEY}"), st.none(), HEADER_TEXT,
            st.sampled_from([f"bearer {FUZZ_KEY}", f"Bearer {FUZZ_KEY[:-1]}", "Bearer x", "Basic abc", "Bearer"])),
        "chunked": st.booleans(),
    })


def _check_answer(response: httpx.Response, route: tuple[str, str], internals: tuple[str, ...]) -> None:
    status = response.status_code
    assert 200 <= status < 300 or 400 <= status < 500, (status, response.text[:500])
    assert "Traceback" not in response.text
    if status >= 400:
        _no_internals(_error(response, status)["message"], *internals)
    elif route == ("POST", CHAT):
        if response.headers["content-type"].startswith("text/event-stream"):
            for line in response.text.splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[len("data: "):])
                    assert "error" not in event or event["error"]["type"] != "server_error", line
        else:
            assert response.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("tenant", ["default", "fuzzer"], ids=["keyless", "keyed"])
def test_fuzzed_requests_never_get_a_500_and_the_server_and_its_memory_survive(tenant, tmp_path):
    """Bodies, headers and content parts from hypothesis (100 examples, a fixed budget), on a
    keyless server (origin checks) and a keyed one: every answer is 2xx or a 4xx OpenAI-shaped
    error without internals, /health answers after, and the tenant's memory file still loads.
    Before: NaN, a 5000-digit integer, deep nesting, a negative seed, a lone surrogate, a 300x1
    image for Qwen's processor were all 500s."""
    images = tmp_path / "images"
    (images / "sub").mkdir(parents=True)
    synthetic_image(1, 24, 24).save(images / "inside.png")
    synthetic_image(2, 24, 24).save(tmp_path / "outside.png")
    (images / "link.png").symlink_to(tmp_path / "outside.png")
    memory = tmp_path / "memory"
    target = load_target("tiny-qwen2.5-vl")
    internals = (target.name, str(tmp_path))
    keys = {FUZZ_KEY: tenant} if tenant != "default" else None
    auth = {"Authorization": f"Bearer {FUZZ_KEY}"}
    with serving("tiny-qwen2.5-vl", memory_dir=str(memory), max_tokens_limit=4, allow_local_images=str(images),
                 max_body_bytes=256 * 1024, api_keys=keys) as (url, app), \
            httpx.Client(base_url=url, timeout=120) as client:
        port = _port(url)
        assert client.post(CHAT, json={"model": "tiny-qwen2.5-vl", "messages": HI}, headers=auth).status_code == 200
        seen: dict[int, int] = {}

        @settings(max_examples=100, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(request=_requests(port))
        def one(request: dict) -> None:
            method, path = request["route"]
            payload = request["payload"]
            content = payload.encode("utf-8", "surrogatepass") if isinstance(payload, str) else payload
            headers = {name.title(): request[name] for name in ("origin", "host", "authorization")
                       if request[name] is not None}
            if request["content_type"] is not None:
                headers["Content-Type"] = request["content_type"]
            body = iter([content[: len(content) // 2], content[len(content) // 2:]]) if request["chunked"] else content
            response = client.request(method, path, content=body if method == "POST" else None, headers=headers)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            _check_answer(response, request["route"], internals)

        one()
        assert client.get("/health").json()["status"] == "ok"
        final = client.post(CHAT, json={"model": "tiny-qwen2.5-vl", "messages": HI}, headers=auth)
        assert final.status_code == 200, final.text
        assert seen.get(200, 0) > 0 and sum(n for s, n in seen.items() if s >= 400) > 0, seen
    saved = read_token_memory(memory / f"{tenant}.safetensors")  # raises if torn or corrupt
    assert saved.vocab_size == target.vocab_size
    assert [p.name for p in memory.iterdir()] == [f"{tenant}.safetensors"]  # nothing moved aside as unusable
    fresh = TenantStreams("recap", target.vocab_size, memory)
    fresh.stream(tenant)
    assert [p.name for p in memory.iterdir()] == [f"{tenant}.safetensors"]


# ----------------------------------------------------------------------------- bounded memory
def test_a_chunked_body_is_cut_off_at_the_limit_and_memory_stays_bounded():
    """32 MiB streamed without Content-Length to a server whose limit is 1 MiB: 413, and the
    process's Python allocations peak under 8 MiB while it is refused (tracemalloc). Before:
    the body was read whole first (the check trusted Content-Length), a peak above 32 MiB."""
    piece = b" " * (64 * 1024)
    total = 32 * 1024 * 1024

    def body():
        for _ in range(total // len(piece)):
            yield piece

    with serving("tiny-llama", max_body_bytes=1024 * 1024) as (url, app):
        assert _post(url, {"model": "tiny-llama", "messages": HI, "max_tokens": 2}).status_code == 200  # warm
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            response = httpx.post(url + CHAT, content=body(), headers=JSON, timeout=120)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 * 1024 * 1024, f"peak {peak / 2**20:.1f} MiB while refusing a 32 MiB chunked body"
        assert _error(response, 413)["code"] == "request_too_large"
        declared = httpx.post(url + CHAT, content=b" " * (2 * 1024 * 1024), headers=JSON, timeout=60)
        assert _error(declared, 413)["code"] == "request_too_large"
        assert httpx.get(url + "/health").json()["status"] == "ok"


def _slow_client(port: int, sent: bytes = b'{"model": "tiny-llama", ') -> socket.socket:
    """A client that sends its headers and the start of a body, then nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall((f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: 100000\r\n\r\n").encode() + sent)
    return sock


def _response(sock: socket.socket) -> str:
    """One whole HTTP response (headers and a Content-Length body) read from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or b"!"
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    while len(body) < length:
        more = sock.recv(65536)
        assert more, "the server closed the connection mid-answer"
        body += more
    return (head + b"\r\n\r\n" + body).decode()


def test_slow_clients_hold_queue_slots_and_time_out():
    """Admission counts a request from before its body is read: two clients trickling bodies
    fill a queue of 2 (the next request gets 429 at once, no body read); once they leave, the
    slots come back; a body that never ends is answered 408 at the request time limit. Before:
    slots were taken only after the whole body and its image and prompt were processed, so any
    number of slow uploads (each up to the body limit) were held at once."""
    with serving("tiny-llama", max_queue=2, request_timeout=60) as (url, app):
        port = _port(url)
        slow = [_slow_client(port) for _ in range(2)]
        try:
            _until(lambda: app.state.admission.preparing == 2, "the slow clients were not admitted")
            error = _error(_post(url, {"model": "tiny-llama", "messages": HI, "max_tokens": 2}), 429)
            assert error["code"] == "queue_full"
        finally:
            for sock in slow:
                sock.close()
        _until(lambda: app.state.admission.preparing == 0, "a gone client kept its slot")
        assert _post(url, {"model": "tiny-llama", "messages": HI, "max_tokens": 2}).status_code == 200
    with serving("tiny-llama", request_timeout=1) as (url, app):
        sock = _slow_client(_port(url))
        with sock:
            answer = _response(sock)
        assert answer.startswith("HTTP/1.1 408") and "request_timeout" in answer
        assert app.state.admission.preparing == 0


@contextlib.contextmanager
def _counting(monkeypatch, target):
    """Count image decodes (Pillow's convert) and tokenisations (target.prepare) in this process."""
    counts = {"decoded": 0, "prepared": 0}
    convert, prepare = Image.Image.convert, target.prepare

    def counted_convert(self, *args, **kwargs):
        counts["decoded"] += 1
        return convert(self, *args, **kwargs)

    def counted_prepare(*args, **kwargs):
        counts["prepared"] += 1
        return prepare(*args, **kwargs)

    monkeypatch.setattr(Image.Image, "convert", counted_convert)
    monkeypatch.setattr(target, "prepare", counted_prepare)
    yield counts


def test_admission_comes_before_any_image_decoding_or_tokenising(monkeypatch):
    """With the decoder busy and the queue full, a request with an image gets 429 before its
    image is decoded or its prompt tokenised; a wrong model name is a 404 before its (broken)
    image is looked at. Before: the image was decoded and the prompt tokenised first (40 MP
    images at ~120 MB each, for any number of requests), and the name was checked after."""
    target = load_target("tiny-qwen2.5-vl")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_url(64, 48)}},
                                          {"type": "text", "text": "What is it?"}]}]
    gate = threading.Event()
    with serving("tiny-qwen2.5-vl", max_queue=1) as (url, app), _counting(monkeypatch, target) as counts:
        tenants = app.state.tenants
        stream = tenants.stream
        monkeypatch.setattr(tenants, "stream", lambda tenant: (gate.wait(60), stream(tenant))[1])
        answers: list[httpx.Response] = []

        def ask() -> None:
            answers.append(_post(url, {"model": "tiny-qwen2.5-vl", "messages": HI, "max_tokens": 2}))

        first, second = threading.Thread(target=ask), threading.Thread(target=ask)
        try:
            first.start()
            _until(lambda: app.state.engine.busy, "the first request did not start")
            second.start()
            _until(lambda: app.state.engine.depth == 1, "the second request did not queue")
            before = dict(counts)
            assert _error(_post(url, {"model": "tiny-qwen2.5-vl", "messages": image, "max_tokens": 2}),
                          429)["code"] == "queue_full"
            assert counts == before, "the refused request's image was decoded or its prompt tokenised"
        finally:
            gate.set()  # a failure above must not leave the decoder blocked
            for thread in (first, second):
                if thread.ident is not None:
                    thread.join(120)
        assert [a.status_code for a in answers] == [200, 200]
        broken = [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64,bm90IGFuIGltYWdl"}}, {"type": "text", "text": "hi"}]}]
        before = dict(counts)
        assert _error(_post(url, {"model": "gpt-17", "messages": broken}), 404)["code"] == "model_not_found"
        assert _error(_post(url, {"model": "tiny-qwen2.5-vl", "messages": broken}), 400)["code"] == "invalid_image"
        assert counts["prepared"] == before["prepared"]
        assert _post(url, {"model": "tiny-qwen2.5-vl", "messages": image, "max_tokens": 2}).status_code == 200


def test_image_size_limits_are_options_checked_before_decoding(monkeypatch):
    """``max_image_pixels`` is checked from the image's header (a 1000x1000 PNG of a few KB is
    refused with 413 without a pixel decoded) and ``max_image_bytes`` before base64 decoding.
    Before: both limits were constants (10 MiB / 40 M pixels) and not options."""
    target = load_target("tiny-qwen2.5-vl")
    big = _png_url(1000, 1000)
    assert len(big) < 150_000  # few bytes, many pixels
    wide = _data_url(synthetic_image(3, 200, 150))

    def ask(url_: str) -> dict:
        return {"model": "tiny-qwen2.5-vl", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url_}}, {"type": "text", "text": "Describe it."}]}]}

    with serving("tiny-qwen2.5-vl", max_image_pixels=100_000, max_image_bytes=150_000) as (url, _), \
            _counting(monkeypatch, target) as counts:
        error = _error(_post(url, ask(big)), 413)
        assert error["code"] == "image_too_large" and "100000 pixels" in error["message"]
        assert counts == {"decoded": 0, "prepared": 0}
        noise = base64.b64encode(bytes(range(256)) * 800).decode()  # 204 800 bytes: over 150 000
        error = _error(_post(url, ask("data:image/png;base64," + noise)), 413)
        assert error["code"] == "image_too_large" and counts["decoded"] == 0
        assert _post(url, ask(wide)).status_code == 200  # 30 000 pixels, under 90 KB: within both
        assert counts["decoded"] >= 1 and counts["prepared"] == 1
        # shapes or places the model's processor refuses were 500s: a 300:1 image, an image without a user turn
        assert _error(_post(url, ask(_png_url(300, 1))), 400)["code"] == "invalid_image"
        system_only = {**ask(wide), "messages": [{**ask(wide)["messages"][0], "role": "system"}]}
        assert _error(_post(url, system_only), 400)["code"] == "invalid_messages"


# ----------------------------------------------------------------------------- origins and Host
def test_cross_origin_and_rebound_requests_are_refused_and_the_playground_origin_is_served():
    """A keyless loopback server answers its own origin (the playground page at ``/`` fetches
    with Origin = the server's origin) and refuses other origins, a DNS-rebinding Host, and a
    body that is not declared JSON (what a cross-site form can send). With keys, the key is the
    protection, as in vLLM and TGI: origins are not checked. Before: every one was served."""
    ok = {"model": "tiny-llama", "messages": HI, "max_tokens": 2}
    with serving("tiny-llama") as (url, _):
        port = _port(url)
        for origin in ("http://evil.example", "null", f"http://127.0.0.1:{port + 1}", f"https://evil.example:{port}",
                       f"http://localhost.evil.example:{port}"):
            error = _error(_post(url, ok, headers={"Origin": origin}), 403)
            assert error["code"] == "forbidden_origin" and error["type"] == "permission_error"
        for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1:{port + 1}", f"192.168.1.2:{port}"):
            assert _error(_post(url, ok, headers={"Host": host}), 403)["code"] == "forbidden_origin"
            assert _error(httpx.get(url + "/health", headers={"Host": host}), 403)["code"] == "forbidden_origin"
        form = httpx.post(url + CHAT, content="messages=hi", timeout=60, headers={
            "Content-Type": "application/x-www-form-urlencoded", "Origin": url})
        assert _error(form, 415)["code"] == "unsupported_media_type"
        assert _error(httpx.post(url + CHAT, content=json.dumps(ok), headers={"Content-Type": "text/plain"}),
                      415)["code"] == "unsupported_media_type"
        page = httpx.get(url + "/", headers={"Host": f"127.0.0.1:{port}"})
        assert page.status_code == 200 and "RECAP playground" in page.text
        assert 'headers = {"Content-Type": "application/json"}' in page.text  # what the page's fetch sends
        for origin, host in ((url, f"127.0.0.1:{port}"), (f"http://localhost:{port}", f"localhost:{port}")):
            answer = _post(url, ok, headers={"Origin": origin, "Host": host, "Sec-Fetch-Site": "same-origin"})
            assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] is not None
    with serving("tiny-llama", api_keys={"key-of-alice-0001": "alice"}) as (url, _):
        keyed = {"Authorization": "Bearer key-of-alice-0001", "Origin": "http://evil.example"}
        assert _post(url, ok, headers=keyed).status_code == 200
        assert _error(_post(url, ok, headers={"Origin": "http://evil.example"}), 401)["code"] == "invalid_api_key"


# ----------------------------------------------------------------------------- tenants and paths
ESCAPING_NAMES = ["../evil", "..", ".hidden", "a/b", "a\\b", "/abs", "", "x" * 65, "alice\n", "-rf", "a b", "é",
                  "nul\x00", 7, None]


@pytest.mark.parametrize("name", ESCAPING_NAMES, ids=repr)
def test_tenant_names_that_could_leave_the_memory_folder_are_refused(name, tmp_path):
    """Names are checked where they enter: ServerConfig (before: unchecked, so
    ``../evil`` wrote ``memory_dir/../evil.safetensors``), the keys file, and the path itself."""
    memory = tmp_path / "memory"
    target = load_target("tiny-llama")
    with pytest.raises(InputError, match="tenant"):
        create_app(target, ServerConfig(model_name="tiny-llama", api_keys={"k" * 16: name}, memory_dir=str(memory)))
    if isinstance(name, str) and "\n" not in name and " " not in name and name:
        keys = tmp_path / "keys"
        keys.write_text(f"{name} key-of-someone-01\n")
        with pytest.raises(InputError, match="line 1"):
            read_api_keys(keys)
    with pytest.raises(ValueError):
        TenantStreams("recap", target.vocab_size, memory).path(name)
    assert sorted(p.name for p in tmp_path.iterdir()) in (["memory"], ["keys", "memory"], [])


def test_the_bearer_scheme_is_case_insensitive_and_the_key_is_not():
    keys = {"key-of-alice-0001": "alice"}
    for header in ("Bearer key-of-alice-0001", "bearer key-of-alice-0001", "BEARER  key-of-alice-0001 "):
        assert tenant_for(keys, header) == "alice", header
    for header in (None, "", "Bearer", "Bearer ", "Basic key-of-alice-0001", "Bearer KEY-OF-ALICE-0001",
                   "Bearerkey-of-alice-0001", "Bearer key-of-alice-000"):
        assert tenant_for(keys, header) is None, header


def test_config_keys_are_checked_like_the_keys_file():
    target = load_target("tiny-llama")
    for keys in ({}, {"short": "alice"}, {"has a space": "alice"}, {12345678: "alice"}):
        with pytest.raises(InputError):
            create_app(target, ServerConfig(model_name="tiny-llama", api_keys=keys))
    with pytest.raises(InputError, match="folder"):
        create_app(target, ServerConfig(model_name="tiny-llama", allow_local_images=True))
    with pytest.raises(InputError, match="not a folder"):
        create_app(target, ServerConfig(model_name="tiny-llama", allow_local_images="/no/such/folder"))
    app = create_app(target, ServerConfig(model_name="tiny-llama", allow_local_images=False))  # the old default
    app.state.engine.shutdown()


def test_local_images_are_read_under_their_folder_only_with_one_message_for_everything_else(tmp_path):
    """A path outside the folder (``..``, absolute, a symlink out, a huge file, a device) gets
    exactly the message a missing file gets, and no path in it. Before: any path on the machine
    was read, a missing file echoed its path, and a large one answered 413 (its size leaked)."""
    images = tmp_path / "images"
    (images / "sub").mkdir(parents=True)
    synthetic_image(1, 24, 24).save(images / "inside.png")
    synthetic_image(2, 24, 24).save(images / "sub" / "deeper.png")
    synthetic_image(3, 24, 24).save(tmp_path / "outside.png")
    (tmp_path / "huge.bin").write_bytes(b"\0" * (3 * 1024 * 1024))
    (images / "link.png").symlink_to(tmp_path / "outside.png")
    (images / "dirlink").symlink_to(tmp_path)

    def ask(path: str) -> dict:
        return {"model": "tiny-qwen2.5-vl", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": path}}, {"type": "text", "text": "What is it?"}]}]}

    with serving("tiny-qwen2.5-vl", allow_local_images=str(images), max_image_bytes=2 * 1024 * 1024) as (url, _):
        for good in ("inside.png", str(images / "inside.png"), "file://" + str(images / "inside.png"),
                     "sub/deeper.png", "sub/../inside.png"):
            assert _post(url, ask(good)).status_code == 200, good
        refused = ["../outside.png", str(tmp_path / "outside.png"), "file://" + str(tmp_path / "outside.png"),
                   "link.png", "dirlink/outside.png", str(tmp_path / "huge.bin"), "../huge.bin", "/dev/zero",
                   "/etc/passwd", "missing.png", "sub", ".", "inside.png\x00", "../" * 40 + "etc/passwd",
                   "x" * 5000]
        for path in refused:
            error = _error(_post(url, ask(path)), 400)
            assert error["message"] == IMAGE_NOT_FOUND and error["code"] == "invalid_image", path
            _no_internals(error["message"], str(tmp_path))


def test_the_cli_takes_an_image_folder_and_refuses_it_on_a_public_host(tmp_path, capsys):
    from recap.cli import main

    with pytest.raises(SystemExit) as exit_:  # the old boolean form: argparse says DIR is missing
        main(["serve", "--model", "tiny-llama", "--allow-local-images"])
    assert exit_.value.code == 2 and "--allow-local-images" in capsys.readouterr().err
    assert main(["serve", "--model", "tiny-llama", "--host", "0.0.0.0", "--allow-local-images", str(tmp_path)]) == 2
    assert "--allow-local-images" in capsys.readouterr().err
    assert main(["serve", "--model", "tiny-llama", "--allow-local-images", str(tmp_path / "none")]) == 2
    assert "not a folder" in capsys.readouterr().err


# ----------------------------------------------------------------------------- bad input
def test_bad_input_is_a_400_never_a_500(monkeypatch):
    """Each of these was a 500 (or worse) before: a negative / huge / fractional seed, a huge
    integer or float literal, NaN, JSON nested deeper than any chat body, a lone surrogate, a
    prompt past the sliding window, and a wrong type in any field."""
    target = load_target("tiny-llama")
    base = {"model": "tiny-llama", "messages": HI, "max_tokens": 2}
    sampled = {**base, "temperature": 0.8}
    raw = json.dumps(base)[:-1]
    cases: list[tuple[str, dict | None, str | None]] = [
        ("negative seed", {**sampled, "seed": -1}, None), ("seed past int64", {**sampled, "seed": 2**64}, None),
        ("fractional seed", {**sampled, "seed": 1.5}, None), ("string seed", {**sampled, "seed": "7"}, None),
        ("greedy with a bad seed", {**base, "seed": -3}, None),
        ("a temperature whose logits overflow", {**sampled, "seed": 1, "temperature": 1e-320}, None),
        ("a bad max_tokens beside a good max_completion_tokens", {**base, "max_tokens": "2",
                                                                  "max_completion_tokens": 2}, None),
        ("huge max_tokens", None, raw + ', "max_completion_tokens": 1' + "0" * 400 + "}"),
        ("5000-digit integer", None, raw + ', "top_k": ' + "9" * 5000 + "}"),
        ("huge temperature", None, raw + ', "temperature": 1e400}'),
        ("NaN temperature", None, raw + ', "temperature": NaN}'),
        ("Infinity top_p", None, raw + ', "temperature": 1, "top_p": Infinity}'),
        ("deep nesting", None, raw + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        ("nesting past the bound", None, raw + ', "x": ' + "[" * 40 + "]" * 40 + "}"),
        ("a lone surrogate", None, '{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\ud800"}]}'),
        ("not UTF-8", None, b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\xff"}]}'),
    ]
    for field, values in {"model": [7, None, ["tiny-llama"]], "messages": ["hi", {}, [], [7], [[]]],
                          "max_tokens": ["2", 2.5, True, 0, -1, {}], "temperature": ["0", True, [], -0.5],
                          "top_p": ["1", True, 0, 1.5], "top_k": ["5", 2.5, True, -1], "n": [2, "1", True, 1.0],
                          "stream": ["yes", 1, {}], "stream_options": ["x", [], {"include_usage": "yes"}]}.items():
        cases += [(f"{field}={value!r}", {**base, field: value}, None) for value in values]
    for role, content in (("robot", "hi"), (["user"], "hi"), ("user", 7), ("user", [{"type": "audio"}]),
                          ("user", [{"type": "text", "text": 7}]), ("user", [{"type": "image_url"}]),
                          ("user", [{"type": "image_url", "image_url": {"url": 7}}]), ("user", ["text"])):
        cases.append((f"message {role!r}: {content!r}", {**base, "messages": [{"role": role, "content": content}]},
                      None))
    with serving("tiny-llama", max_tokens_limit=64) as (url, _):
        for _name, body, literal in cases:
            response = _post(url, body, raw=literal.encode() if isinstance(literal, str) else literal)
            _no_internals(_error(response, 400)["message"], target.name)
        # a model whose attention window is shorter than its context: the window bounds the prompt
        monkeypatch.setattr(target, "sliding_window", 48)
        long_prompt = [{"role": "user", "content": "word " * 60}]
        error = _error(_post(url, {"model": "tiny-llama", "messages": long_prompt}), 400)
        assert error["code"] == "context_length_exceeded" and "sliding attention window" in error["message"]
        error = _error(_post(url, {**base, "messages": [{"role": "user", "content": "word " * 20}], "max_tokens": 40}),
                       400)
        assert "sliding attention window of 48" in error["message"]
        assert httpx.get(url + "/health").json()["status"] == "ok"


def test_a_prompt_that_cannot_fit_is_refused_before_tokenising_and_a_template_refusal_is_a_400(monkeypatch):
    """More characters than the context holds at the vocabulary's longest token: 400
    ``context_length_exceeded`` with nothing tokenised; a chat template that refuses the
    messages (``raise_exception``: no system role, roles that must alternate) is a 400
    ``invalid_messages``. Before: the text was tokenised first (a 16 MB prompt took 20 s and
    2 GB, while every other request waited to be prepared), and a template's refusal was a 500."""
    target = load_target("tiny-llama")
    most = max(len(piece) for piece in target.tokenizer.get_vocab()) * target.max_context
    with serving("tiny-llama") as (url, _), _counting(monkeypatch, target) as counts:
        parts = [{"type": "text", "text": "a" * (most // 2)}, {"type": "text", "text": "a" * (most // 2 + 2)}]
        for messages in ([{"role": "user", "content": "a" * (most + 1)}],
                         [{"role": "system", "content": "hi"}, {"role": "user", "content": parts}]):
            error = _error(_post(url, {"model": "tiny-llama", "messages": messages}), 400)
            assert error["code"] == "context_length_exceeded" and "characters" in error["message"]
        assert counts["prepared"] == 0
        monkeypatch.setattr(target.tokenizer, "chat_template", "{% for m in messages %}{% if m['role'] == 'system' %}"
                            "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}"
                            "{% endfor %}")
        error = _error(_post(url, {"model": "tiny-llama", "max_tokens": 2,
                                   "messages": [{"role": "system", "content": "be brief"}, *HI]}), 400)
        assert error["code"] == "invalid_messages" and "System role not supported" in error["message"]
        _no_internals(error["message"], target.name)
        assert _post(url, {"model": "tiny-llama", "messages": HI, "max_tokens": 2}).status_code == 200


def test_errors_show_no_server_paths_or_class_names(monkeypatch):
    """A prompt past the context names the model, not its folder; a failure inside decoding
    is "internal server error" (details in the log). Before: the folder's absolute path, and
    "internal error: RuntimeError"."""
    target = load_target("tiny-llama")
    assert Path(target.name).is_absolute()  # the leak this guards against is possible here
    with serving("tiny-llama") as (url, app):
        error = _error(_post(url, {"model": "tiny-llama", "messages": [{"role": "user", "content": "word " * 5000}]}),
                       400)
        assert "tiny-llama" in error["message"]
        _no_internals(error["message"], target.name)

        def broken(tenant):
            raise RuntimeError(f"secret detail in {target.name}")

        monkeypatch.setattr(app.state.tenants, "stream", broken)
        error = _error(_post(url, {"model": "tiny-llama", "messages": HI, "max_tokens": 2}), 500)
        assert error["message"] == "internal server error" and error["type"] == "server_error"
        streamed = _post(url, {"model": "tiny-llama", "messages": HI, "max_tokens": 2, "stream": True})
        assert streamed.status_code == 200 and "internal server error" in streamed.text
        assert "RuntimeError" not in streamed.text and target.name not in streamed.text


def test_a_request_after_shutdown_began_is_answered_503_not_429():
    """A server that is shutting down will not take the request however long the client waits:
    503 (``shutting_down``), not 429's "busy, retry later" with a Retry-After."""
    with serving("tiny-llama") as (url, app):
        assert _post(url, {"model": "tiny-llama", "messages": HI, "max_tokens": 2}).status_code == 200
        app.state.engine.shutdown()
        response = _post(url, {"model": "tiny-llama", "messages": HI, "max_tokens": 2})
        error = _error(response, 503)
        assert error["code"] == "shutting_down" and "retry-after" not in response.headers


def test_fields_that_would_change_the_answer_are_refused_not_ignored():
    """Penalties, logprobs, tools, a JSON response format...: a server that ignored them would
    hand back an answer the client reads as if they had been applied. Their neutral values,
    and fields that change nothing (``user``, ``metadata``), pass; a malformed ``stop`` is a 400."""
    from recap.serve.chat import ApiError, parse_chat_request

    base = {"model": "m", "messages": HI}
    for value in (5, [""], ["a", "b", "c", "d", "e"], ["x" * 257], [1]):
        with pytest.raises(ApiError) as refused:
            parse_chat_request({**base, "stop": value})
        assert refused.value.code == "invalid_stop"
    assert parse_chat_request({**base, "stop": "END"}).stop == ("END",)
    assert parse_chat_request({**base, "stop": ["a", "b", "a"]}).stop == ("a", "b")
    for field, value in (("presence_penalty", 0.5), ("frequency_penalty", 1),
                         ("logprobs", True), ("top_logprobs", 2), ("logit_bias", {"42": 5}),
                         ("tools", [{"type": "function"}]), ("response_format", {"type": "json_object"}),
                         ("presence_penalty", False)):
        with pytest.raises(ApiError) as refused:
            parse_chat_request({**base, field: value})
        assert refused.value.status == 400 and refused.value.code == "unsupported_parameter"
        assert field in refused.value.message
    for field, value in (("stop", None), ("stop", []), ("presence_penalty", 0), ("frequency_penalty", 0.0),
                         ("logprobs", False), ("tools", []), ("response_format", {"type": "text"}),
                         ("user", "alice"), ("metadata", {"a": "b"}), ("store", False)):
        assert parse_chat_request({**base, field: value}).messages
    with serving("tiny-llama") as (url, _):
        error = _error(_post(url, {"model": "tiny-llama", "messages": HI, "logprobs": True}), 400)
        assert error["code"] == "unsupported_parameter"
