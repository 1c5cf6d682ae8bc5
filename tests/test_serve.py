"""`recap serve`: a real server on 127.0.0.1 (a free port), called with the real `openai` client.

Answers must equal greedy decoding (`--method ar`) token for token, streamed or not, under
concurrency; tenants never share memory; errors are JSON, never tracebacks.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from hypothesis import example, given, settings
from hypothesis import strategies as st

from recap.decoding import decode
from recap.images import synthetic_image
from recap.proposers import make_proposer
from recap.serve import ServerConfig, create_app
from tests.conftest import TINY_MODELS, TINY_VISION_MODELS, load_target
from tests.helpers import assert_drafted


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serving(model: str, **options):
    """A real uvicorn server in a thread; yields its base URL and the app."""
    app = create_app(load_target(model), ServerConfig(model_name=model, **options))
    with running(app) as url:
        yield url, app


@contextlib.contextmanager
def running(app):
    """Serve ``app`` with a real uvicorn server in a thread on a free loopback port; yields
    the base URL and stops the server on exit."""
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)


def _client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def _data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _greedy_text(model: str, prompt: str, image=None, max_tokens: int = 16) -> str:
    target = load_target(model)
    result = decode(target, make_proposer("ar"), target.prepare(prompt, image), max_new_tokens=max_tokens)
    return target.tokenizer.decode(result.tokens, skip_special_tokens=True)


def _content(prompt: str, image=None):
    if image is None:
        return prompt
    return [{"type": "image_url", "image_url": {"url": _data_url(image)}}, {"type": "text", "text": prompt}]


def _streamed(client, model, prompt, image=None, max_tokens=16, recap: dict | None = None):
    """(text, usage, finish reason) of a streamed answer; ``recap`` receives its final
    ``recap`` block (drafted and accepted tokens), sent with the usage."""
    messages = [{"role": "user", "content": _content(prompt, image)}]
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, stream=True,
                                            stream_options={"include_usage": True})
    text, usage, finish = "", None, None
    for part in stream:
        if part.choices:
            text += part.choices[0].delta.content or ""
            finish = part.choices[0].finish_reason or finish
        if part.usage is not None:
            usage = part.usage
            if recap is not None:
                recap.update(part.model_extra["recap"])
    return text, usage, finish


def _metric(url: str, name: str) -> float:
    """A sample's value on /metrics (0 when absent)."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0


def _wait_for(condition, message: str, timeout: float = 60.0, interval: float = 0.002) -> None:
    """Poll ``condition`` until it holds (the timeout only turns a hang into a failure)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(interval)


@pytest.mark.lossless
@pytest.mark.parametrize("model", TINY_MODELS)
def test_answers_equal_greedy_streamed_or_not(model):
    image = synthetic_image(3, 48, 40) if model in TINY_VISION_MODELS else None
    prompts = ["Tell me about the sea.", "Tell me about the sea."]  # twice: the second drafts from the first
    expected = _greedy_text(model, prompts[0], image, 16)
    with serving(model) as (url, app):
        client = _client(url)
        answer = client.chat.completions.create(model=model, max_tokens=16,
                                                messages=[{"role": "user", "content": _content(prompts[0], image)}])
        assert answer.choices[0].message.content == expected
        assert answer.usage.completion_tokens <= 16 and answer.model_extra["recap"]["method"] == "recap"
        recap = {}
        text, usage, finish = _streamed(client, model, prompts[1], image, recap=recap)
        assert text == expected and usage is not None and finish in ("stop", "length")
        assert_drafted(recap, min_accepted=usage.completion_tokens // 2)  # drafted from the first answer
        assert client.models.list().data[0].id == model
    assert app.state.tenants.streams["default"].store.flat().count(-1) == 2


@pytest.mark.lossless
def test_concurrent_image_and_text_requests_are_batched_and_equal_greedy():
    """Image and text requests at once, streamed and not, on a VLM: they share steps (the
    batch holds several at a time) and every answer is greedy decoding of it alone."""
    model = "tiny-qwen2.5-vl"
    cases = [(f"Tell me about picture {i}." if i % 2 else f"Count to {i + 3}, please.",
              synthetic_image(i, 48, 40) if i % 2 else None, i % 3 == 0) for i in range(8)]
    cases += cases[:4]  # asked again: those copies draft from the first answers
    expected = {(p, i is not None): _greedy_text(model, p, i, 12) for p, i, _ in cases}
    with serving(model, max_batch=4) as (url, app):
        client = _client(url)
        vision = app.state.engine.target.model.model.visual
        towers = []  # the threads the vision tower ran on: the HTTP workers, never the decoder
        hook = vision.register_forward_hook(lambda *_: towers.append(threading.current_thread().name))

        def ask(case):
            prompt, image, stream = case
            if stream:
                return _streamed(client, model, prompt, image, max_tokens=12)[0]
            reply = client.chat.completions.create(model=model, max_tokens=12,
                                                   messages=[{"role": "user", "content": _content(prompt, image)}])
            return reply.choices[0].message.content

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, cases))
        hook.remove()
        assert answers == [expected[p, i is not None] for p, i, _ in cases]
        assert app.state.engine.batch.peak_running > 1, "the requests were never batched"
        assert len(towers) == 6 and "recap-decoder" not in towers
        assert_drafted({"accepted_tokens": _metric(url, "recap_accepted_tokens_total")})


@pytest.mark.lossless
def test_the_demo_vlm_answers_an_image_like_greedy():
    from recap.demo_vlm.scenes import HELD_OUT_START, make_example

    image = make_example(HELD_OUT_START + 3).image()
    expected = _greedy_text("recap-demo-vlm", "Describe the image.", image, 32)
    with serving("recap-demo-vlm") as (url, _):
        client = _client(url)
        for _ in range(2):
            recap = {}
            text, usage, _ = _streamed(client, "recap-demo-vlm", "Describe the image.", image, 32, recap=recap)
            assert text == expected and usage.completion_tokens > 3
        assert_drafted(recap, min_accepted=usage.completion_tokens // 2)  # the second drafted from the first


@pytest.mark.lossless
def test_forty_requests_from_eight_clients_all_greedy_and_a_full_queue_answers_429():
    # 20 prompts, each asked twice: whichever copy the decoder takes second drafts from the first
    prompts = [f"Item {i % 20}: say something about number {i % 20 % 7}." for i in range(40)]
    expected = {p: _greedy_text("tiny-llama", p, max_tokens=10) for p in set(prompts)}
    with serving("tiny-llama", max_queue=64) as (url, app):
        client = _client(url)

        def ask(prompt):
            reply = client.chat.completions.create(model="tiny-llama", max_tokens=10,
                                                   messages=[{"role": "user", "content": prompt}])
            return prompt, reply.choices[0].message.content

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, prompts))
        assert len(answers) == 40 and all(text == expected[p] for p, text in answers)
        assert app.state.engine.batch.peak_running > 1, "the requests were never batched"
        metrics = httpx.get(f"{url}/metrics").text
        assert 'recap_requests_total{status="ok"} 40.0' in metrics
        assert_drafted({"accepted_tokens": _metric(url, "recap_accepted_tokens_total")}, min_accepted=20 * 4)
    with serving("tiny-llama", max_queue=1) as (url, _):
        def raw(prompt):
            response = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": "tiny-llama", "max_tokens": 24, "messages": [{"role": "user", "content": prompt}]})
            return prompt, response

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(raw, prompts[:8]))
        busy = [r for _, r in results if r.status_code == 429]
        served = [(p, r) for p, r in results if r.status_code == 200]
        assert busy and served and len(busy) + len(served) == 8
        assert all(r.headers.get("retry-after") and r.json()["error"]["code"] == "queue_full" for r in busy)
        for prompt, response in served:
            assert response.json()["choices"][0]["message"]["content"] == _greedy_text("tiny-llama", prompt, None, 24)


def test_tenants_never_share_a_stream_or_a_memory_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# tenant key\nalice key-of-alice-0001\nbob key-of-bob-00002\n")
    from recap.serve.tenants import read_api_keys

    api_keys = read_api_keys(keys)
    memory = tmp_path / "memory"
    with serving("tiny-llama", api_keys=api_keys, memory_dir=str(memory)) as (url, app):
        alice, bob = _client(url, "key-of-alice-0001"), _client(url, "key-of-bob-00002")
        for prompt in ("Alice talks about apples.", "Alice talks about apples again."):
            alice.chat.completions.create(model="tiny-llama", max_tokens=12,
                                          messages=[{"role": "user", "content": prompt}])
        assert app.state.tenants.flush(60)  # the saver thread has written alice's saves
        alice_file = (memory / "alice.safetensors").read_bytes()
        for prompt in ("Bob asks about boats.", "Bob asks about boats again."):
            bob.chat.completions.create(model="tiny-llama", max_tokens=12,
                                        messages=[{"role": "user", "content": prompt}])
        assert app.state.tenants.flush(60)
        assert (memory / "alice.safetensors").read_bytes() == alice_file  # B's requests never touch A's file
        streams = app.state.tenants.streams
        assert streams["alice"] is not streams["bob"]
        alice_outputs = streams["alice"].store.flat()
        bob_outputs = streams["bob"].store.flat()
        assert alice_outputs and bob_outputs and alice_outputs != bob_outputs
        with pytest.raises(openai.AuthenticationError):
            _client(url, "not-a-key").chat.completions.create(model="tiny-llama", max_tokens=2,
                                                              messages=[{"role": "user", "content": "hi"}])
    # Bob's memory is exactly what Bob's requests alone make (recap-paper: deterministic trees).
    def bob_memory(with_alice: bool, folder: Path) -> dict:
        with serving("tiny-llama", method="recap-paper", api_keys=api_keys, memory_dir=str(folder)) as (url, _):
            if with_alice:
                _client(url, "key-of-alice-0001").chat.completions.create(
                    model="tiny-llama", max_tokens=12, messages=[{"role": "user", "content": "Alice's apples."}])
            _client(url, "key-of-bob-00002").chat.completions.create(
                model="tiny-llama", max_tokens=12, messages=[{"role": "user", "content": "Bob's boats."}])
        from recap.core.persistence import read_token_memory

        saved = read_token_memory(folder / "bob.safetensors")
        return {"keys": saved.keys, "ids": saved.ids, "store": saved.store}

    alone, mixed = bob_memory(False, tmp_path / "alone"), bob_memory(True, tmp_path / "mixed")
    assert all(np.array_equal(alone[k], mixed[k]) for k in alone)


def test_a_corrupt_memory_file_is_moved_aside_and_the_tenant_starts_cold(tmp_path, caplog):
    memory = tmp_path / "memory"
    memory.mkdir()
    (memory / "default.safetensors").write_bytes(b"garbage")
    with serving("tiny-llama", memory_dir=str(memory)) as (url, _):
        reply = _client(url).chat.completions.create(model="tiny-llama", max_tokens=6,
                                                     messages=[{"role": "user", "content": "Hello"}])
        assert reply.choices[0].message.content == _greedy_text("tiny-llama", "Hello", None, 6)
    names = sorted(p.name for p in memory.iterdir())
    assert "default.safetensors" in names and any(n.startswith("default.safetensors.unreadable-") for n in names)
    assert any("moved to" in r.message for r in caplog.records)


CRASH_WRITER = """
import importlib.util, sys, types
import numpy as np
# only numpy is needed: skip the recap package's __init__ (torch, transformers: seconds per start)
package = types.ModuleType("recap")
package.__path__ = list(importlib.util.find_spec("recap").submodule_search_locations)
sys.modules["recap"] = package
from recap.core.persistence import save_token_memory
path = sys.argv[1]
rng = np.random.default_rng(0)
states = []
for n in (3000, 5000):
    keys = np.arange(n, dtype=np.int64)
    ids = rng.integers(0, 49152, (n, 8))
    probs = np.full((n, 8), 1 / 8, dtype=np.float32)
    states.append((keys, ids, probs, np.arange(n, dtype=np.int64) % 100))
print("ready", flush=True)
i = 0
while True:
    keys, ids, probs, store = states[i % 2]
    save_token_memory(path, keys, ids, probs, vocab_size=49152, store=store)
    i += 1
"""


def _file_version(path: Path):
    """What changes with every completed save (atomic: a new inode each time); None if absent."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def test_sigkill_during_memory_saves_never_leaves_an_unloadable_file(tmp_path):
    from recap.core.persistence import read_token_memory

    path = tmp_path / "tenant.safetensors"
    for round_ in range(6):
        before, leftovers = _file_version(path), {p.name for p in tmp_path.iterdir()}
        writer = subprocess.Popen([sys.executable, "-c", CRASH_WRITER, str(path)], stdout=subprocess.PIPE, text=True,
                                  cwd=Path(__file__).resolve().parents[1])
        try:
            assert writer.stdout.readline().strip() == "ready"
            # (no sleeps) a save of this writer has landed, so the file exists and is this round's
            _wait_for(lambda old=before: _file_version(path) != old, "the writer never completed a save")
            if round_ % 2:  # and on every other round, the kill lands while its next save is being written
                _wait_for(lambda old=leftovers: {p.name for p in tmp_path.iterdir()} - old - {path.name},
                          "no save in flight was ever seen")
        finally:
            writer.send_signal(signal.SIGKILL)
            writer.wait()
        saved = read_token_memory(path)  # raises if the file were torn
        assert len(saved.keys) in (3000, 5000) and len(saved.store) == len(saved.keys)


def test_sigterm_finishes_and_saves_memories_then_exits_0(tmp_path):
    port = _free_port()
    memory = tmp_path / "memory"
    server = subprocess.Popen([sys.executable, "-m", "recap.cli", "serve", "--model", "tiny-llama", "--port", str(port),
                               "--memory-dir", str(memory), "--threads", "1", "--cost-profile", "flat"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=Path(__file__).resolve().parents[1], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline and server.poll() is None, "the server did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        reply = _client(f"http://127.0.0.1:{port}").chat.completions.create(
            model="tiny-llama", max_tokens=6, messages=[{"role": "user", "content": "Hello"}])
        assert reply.choices[0].message.content
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
    finally:
        if server.poll() is None:
            server.kill()
    assert (memory / "default.safetensors").exists()


# ----------------------------------------------------------------------------- errors
def _post(url, body=None, *, raw=None, headers=None):
    headers = {"Content-Type": "application/json", **(headers or {})}  # raw bodies too: the server requires it
    response = httpx.post(f"{url}/v1/chat/completions", json=body if raw is None else None,
                          content=raw, headers=headers, timeout=60)
    text = response.text
    assert "Traceback" not in text
    return response.status_code, response.json()["error"]


def test_every_error_is_json_with_its_status(tmp_path):
    image = tmp_path / "a.png"
    synthetic_image(0, 16, 16).save(image)
    ok_message = [{"role": "user", "content": "hi"}]
    with serving("tiny-llama", max_tokens_limit=64, max_body_bytes=200_000) as (url, app):
        assert _post(url, raw=b"{not json")[0] == 400
        assert _post(url, {"model": "tiny-llama", "messages": []})[0] == 400
        status, error = _post(url, {"model": "tiny-llama", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}},
            {"type": "text", "text": "hi"}]}]})
        # a text-only model refuses any image before decoding it (tests/test_serve_security.py: invalid_image)
        assert status == 400 and error["code"] == "image_not_supported"
        status, error = _post(url, {"model": "tiny-llama", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _data_url(synthetic_image(0, 16, 16))}}]}]})
        assert status == 400 and "text-only" in error["message"]
        status, error = _post(url, {"model": "tiny-llama", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]})
        assert status == 400 and error["code"] == "image_url_not_supported"
        status, error = _post(url, {"model": "tiny-llama", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": str(image)}}]}]})
        assert status == 400 and "--allow-local-images" in error["message"]
        status, error = _post(url, {"model": "tiny-llama", "messages": ok_message, "max_tokens": 65})
        assert status == 400 and error["code"] == "max_tokens_too_large"
        target = load_target("tiny-llama")
        words = target.max_context - 30
        words -= target.prepare("word " * words).input_ids.shape[1] - (target.max_context - 30)
        long_prompt = "word " * words  # 30 tokens short of the context: 60 new tokens do not fit
        status, error = _post(url, {"model": "tiny-llama", "messages": [{"role": "user", "content": long_prompt}],
                                    "max_tokens": 60})
        assert status == 400 and "context" in error["message"]
        assert _post(url, {"model": "tiny-llama", "messages": ok_message, "temperature": -1})[0] == 400
        assert _post(url, {"model": "tiny-llama", "messages": ok_message, "temperature": 1, "top_p": 3})[0] == 400
        status, error = _post(url, {"model": "gpt-17", "messages": ok_message})
        assert status == 404 and error["code"] == "model_not_found"
        assert _post(url, raw=b"x" * 300_000)[0] == 413
        assert httpx.get(f"{url}/nowhere").status_code == 404 and "error" in httpx.get(f"{url}/nowhere").json()

        def broken(*args, **kwargs):
            raise RuntimeError("secret internal detail")

        app.state.tenants.stream = broken
        status, error = _post(url, {"model": "tiny-llama", "messages": ok_message, "max_tokens": 4})
        assert status == 500 and "secret" not in error["message"] and error["type"] == "server_error"
    with serving("tiny-llama", api_keys={"k" * 16: "t"}) as (url, _):
        status, error = _post(url, {"model": "tiny-llama", "messages": ok_message})
        assert status == 401 and error["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models").status_code == 401


def test_a_client_that_disconnects_cancels_its_request():
    with serving("tiny-llama", max_tokens_limit=4096) as (url, app):
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
                "model": "tiny-llama", "stream": True, "max_tokens": 2000,
                "messages": [{"role": "user", "content": "Write forever."}]}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        # The request's end is what the metrics record; `busy` alone may clear before they do.
        _wait_for(lambda: _metric(url, 'recap_requests_total{status="499"}') == 1.0 and not app.state.engine.busy,
                  "the cancelled request kept decoding", timeout=30, interval=0.05)
        assert _metric(url, 'recap_requests_total{status="ok"}') == 0


def test_the_cli_refuses_a_public_host_without_keys(capsys):
    from recap.cli import main

    assert main(["serve", "--model", "tiny-llama", "--host", "0.0.0.0"]) == 2
    assert "--api-keys" in capsys.readouterr().err


def test_the_playground_page_is_served():
    with serving("tiny-llama") as (url, _):
        page = httpx.get(url).text
        assert "RECAP playground" in page and "tiny-llama" in page and "drafted" in page
        assert json.loads(httpx.get(f"{url}/health").text)["status"] == "ok"


def test_each_tenant_memory_is_bounded(tmp_path):
    from recap.core.persistence import read_token_memory

    with serving("tiny-llama", memory_dir=str(tmp_path), memory_rows=10) as (url, app):
        _client(url).chat.completions.create(model="tiny-llama", max_tokens=12,
                                             messages=[{"role": "user", "content": "A request with many words in it."}])
        assert app.state.tenants.streams["default"].memory_counts()[0] == 10
    assert len(read_token_memory(tmp_path / "default.safetensors").keys) == 10


def test_a_request_past_the_time_limit_is_stopped_with_504():
    """Past ``request_timeout`` while decoding (each step slowed: 500 tokens would take 5 s)
    the decoder stops the request: 504. One that runs out of time before it was even
    prepared gets 504 too, never reaching the decoder."""
    with serving("tiny-llama", request_timeout=0.001, max_tokens_limit=512) as (url, app):
        status, error = _post(url, {"model": "tiny-llama", "max_tokens": 500,
                                    "messages": [{"role": "user", "content": "Write at length."}]})
        assert status == 504 and "time limit" in error["message"] and not app.state.engine.busy
    with serving("tiny-llama", request_timeout=1.0, max_tokens_limit=512) as (url, app):
        batch = app.state.engine.batch
        step = batch.step
        batch.step = lambda: time.sleep(0.01) or step()
        status, error = _post(url, {"model": "tiny-llama", "max_tokens": 500,
                                    "messages": [{"role": "user", "content": "Write at length."}]})
        assert status == 504 and "time limit" in error["message"]
        _wait_for(lambda: not app.state.engine.busy and _metric(url, 'recap_requests_total{status="504"}') == 1.0,
                  "the engine kept decoding past the time limit", timeout=30, interval=0.05)


@pytest.mark.lossless
def test_sampled_answers_follow_the_seed_like_plain_sampling():
    from recap.verifier.sampling import Sampling

    target = load_target("tiny-llama")
    expected = target.tokenizer.decode(decode(target, make_proposer("ar"), target.prepare("Once upon a time"),
                                              max_new_tokens=12, sampling=Sampling(0.9, 20, 0.95, 7)).tokens,
                                       skip_special_tokens=True)
    with serving("tiny-llama") as (url, _):
        client = _client(url)
        for _ in range(2):
            reply = client.chat.completions.create(model="tiny-llama", max_tokens=12, temperature=0.9, top_p=0.95,
                                                   seed=7, extra_body={"top_k": 20},
                                                   messages=[{"role": "user", "content": "Once upon a time"}])
            assert reply.choices[0].message.content == expected
        assert_drafted(reply, min_accepted=4)  # the second drew the same tokens, drafted from the first


def test_the_default_batch_is_read_off_the_cost_profile():
    """`--max-batch` by default: the most requests whose one-row-each step costs at most twice a
    one-token step on this machine's profile; one at a time where lanes cannot share a forward."""
    from recap.core import CostProfile
    from recap.serve.engine import default_max_batch

    class Lanes:
        batches = True

        def __init__(self, profile):
            self.profile = profile

        def verify_cost(self):
            return self.profile

    assert default_max_batch(Lanes(CostProfile.linear(0.06))) == 17  # 1 + 0.06 (B - 1) <= 2
    assert default_max_batch(Lanes(CostProfile.linear(0.5))) == 3
    assert default_max_batch(Lanes(CostProfile.linear(5.0))) == 2  # batching still pays a little
    assert default_max_batch(Lanes(CostProfile.flat())) == 64
    assert default_max_batch(load_target("tiny-llama", kernels="stock")) == 1


@given(st.lists(st.text("ab\n", max_size=6), max_size=8), st.lists(st.text("ab\n", min_size=1, max_size=3),
                                                                    min_size=1, max_size=4))
@settings(max_examples=300, deadline=None)
@example(deltas=["ba", "a"], stops=["a", "baa"])   # "baa" at 0 wins over "a" at 1, seen in the first delta
@example(deltas=["ba"], stops=["a", "baa"])        # the answer ends: "a" at 1 was the first after all
def test_stop_strings_cut_at_the_first_match_whatever_the_deltas(deltas, stops):
    """However the answer's text is split into step deltas, what is sent is the text before
    the first occurrence of any stop string (all of it if none occurs), and a delta is sent as
    soon as no stop string can begin in it."""
    from recap.serve.engine import StopStrings

    whole = "".join(deltas)
    hits = [i for i in (whole.find(s) for s in stops) if i >= 0]
    expected = whole[:min(hits)] if hits else whole
    matcher, sent, stopped = StopStrings(stops), "", False
    for delta in deltas:
        out, stopped = matcher.feed(delta)
        sent += out
        if stopped:
            break
    if not stopped:
        tail, stopped = matcher.flush()
        sent += tail
    assert sent == expected == matcher.text and stopped == bool(hits)


def test_a_stop_string_ends_the_answer_streamed_or_not():
    """The answer ends before the first stop string, with finish_reason "stop"; streamed deltas
    add up to the same text, none of the stop string sent; the request leaves the batch."""
    model = "tiny-llama"
    full = _greedy_text(model, "Count from one to ten.", max_tokens=24)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    expected = full[:full.find(stop)]
    assert stop and expected != full
    with serving(model) as (url, app):
        client = _client(url)
        messages = [{"role": "user", "content": "Count from one to ten."}]
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=24, stop=[stop, "\x00"])
        assert reply.choices[0].message.content == expected and reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens < 24
        text, finish = "", None
        for part in client.chat.completions.create(model=model, messages=messages, max_tokens=24, stop=stop,
                                                   stream=True):
            if part.choices:
                text += part.choices[0].delta.content or ""
                finish = part.choices[0].finish_reason or finish
        assert text == expected and finish == "stop"
        assert not app.state.engine.busy
