"""SIGTERM with requests in flight (issue 46): every client gets a final answer.

uvicorn's own graceful shutdown waits for connections to close and then cancels the handlers
still running; `recap.serve.http.DrainingServer` drains the engine first. Each test says what
the server did before."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time

import httpx
import uvicorn

from recap.serve import ServerConfig, create_app
from recap.serve.http import DrainingServer
from tests.conftest import load_target
from tests.test_serve import _free_port, _wait_for
from tests.test_serve_hostile import CHAT, _slow_steps


@contextlib.contextmanager
def _draining(app, grace: float):
    """``app`` on a `DrainingServer` in a thread; yields (url, server). The test sends the
    exit signal itself (`handle_exit`, what uvicorn's signal handler calls)."""
    port = _free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = DrainingServer(config, app.state.engine.drain, grace=grace)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait_for(lambda: server.started, "the server did not start", timeout=30)
    try:
        yield f"http://127.0.0.1:{port}", server, thread
    finally:
        server.should_exit = True
        thread.join(60)


def _stream_events(url: str, events: list, failures: list) -> None:
    body = {"model": "tiny-llama", "max_tokens": 4000, "stream": True,
            "messages": [{"role": "user", "content": "Tell me everything."}]}
    try:
        with httpx.stream("POST", url + CHAT, json=body, timeout=120) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.HTTPError as error:  # the connection was cut before the stream ended
        failures.append(repr(error))


def test_sigterm_gives_every_request_its_final_answer():
    """One streamed request decoding (it would need far longer than the grace), one waiting
    behind it (one lane): after the exit signal the waiting one is answered 503 at once, the
    streamed one ends with a 503 event and ``[DONE]`` once the grace is over, a new request
    is refused, and the server stops. Before (uvicorn's shutdown alone, same grace, run on
    the old code): the waiting request got a plain-text 500 "Internal Server Error" and the
    stream was cut without its last event (httpx: "peer closed connection without sending
    complete message body") when uvicorn cancelled the handlers."""
    app = create_app(load_target("tiny-llama"), ServerConfig(model_name="tiny-llama", method="ar",
                                                              max_tokens_limit=4000, max_batch=1))
    _slow_steps(app, 0.01)
    engine = app.state.engine
    with _draining(app, grace=1.0) as (url, server, thread):
        events: list[str] = []
        failures: list[str] = []
        streaming = threading.Thread(target=_stream_events, args=(url, events, failures))
        streaming.start()
        _wait_for(lambda: len(events) >= 3, "the stream never started", timeout=60)
        waiting: list[httpx.Response] = []
        asking = threading.Thread(target=lambda: waiting.append(httpx.post(url + CHAT, timeout=120, json={
            "model": "tiny-llama", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]})))
        asking.start()
        _wait_for(lambda: engine.depth == 1, "the second request never queued", timeout=60)

        signalled = time.monotonic()
        server.handle_exit(signal.SIGTERM, None)
        asking.join(60)
        assert waiting and waiting[0].status_code == 503, waiting and waiting[0].text
        assert "shutting down" in waiting[0].json()["error"]["message"]
        streaming.join(60)
        assert not failures, failures
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["error"]["code"] == "shutting_down" and "shutting down" in last["error"]["message"], last
        assert time.monotonic() - signalled >= 1.0  # it had its grace
        thread.join(60)
        assert not thread.is_alive(), "the server did not stop"
    assert not engine.busy


def test_a_request_arriving_while_draining_is_refused_with_503():
    """Between the exit signal and the last connection closing, a kept-alive connection can
    still send a request: it gets 503 ``shutting_down``. Before: the engine knew nothing of
    the signal until uvicorn's grace had ended, so it queued the request (then cut it)."""
    app = create_app(load_target("tiny-llama"), ServerConfig(model_name="tiny-llama", method="ar",
                                                              max_tokens_limit=4000, max_batch=1))
    _slow_steps(app, 0.01)
    with _draining(app, grace=30.0) as (url, server, _):
        app.state.engine.drain(30.0)  # what the signal starts (the listener stays open here)
        reply = httpx.post(url + CHAT, timeout=60, json={
            "model": "tiny-llama", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]})
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "shutting_down"
