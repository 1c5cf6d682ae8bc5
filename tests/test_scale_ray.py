"""`recap serve --replicas`: the server's app in front of two Ray replicas of the tiny
model (one lane group each), on a private Ray instance on loopback, called with the real
`openai` client.

40 requests of 4 tenants from 8 clients equal greedy decoding; each tenant's memory file
counts exactly its requests, also for a tenant whose burst spills onto both replicas (the
file locks, not affinity, keep it right); a replica killed with SIGKILL mid-load fails no
non-streamed request (each is run again on the survivor), ends the stream it had started
with an error event, tears no memory file, and the survivor answers every tenant. Skipped
without Ray (``recap-decoding[ray]``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from recap.serve import ServerConfig, create_app
from recap.serve.scale import control
from recap.serve.shared import REQUESTS_KEY, memory_metadata
from tests.conftest import fixed_cost_profile, load_target
from tests.test_serve import _greedy_text, running

# not imported here: Ray must be first imported by `recap.serve.scale.connect` (loopback only)
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs recap-decoding[ray]"),
              pytest.mark.xdist_group("ray")]  # one worker: one private Ray instance at a time

MODEL = "tiny-llama"
KEYS = {f"key-of-tenant-{i:02d}": f"tenant-{i}" for i in range(4)}
FRESH = {f"key-of-tenant-{i:02d}": f"tenant-{i}" for i in (4, 5)}
"""Two more tenants, used only by the isolation test."""
PROMPTS = ["Tell me about the sea.", "Name three colours.", "Count to ten.", "What is a tree?"]
MAX_TOKENS = 12
LONG = 160
"""Tokens of the answers in flight when a replica is killed: long enough to be mid-decode."""


@contextlib.contextmanager
def scaled_server(folder, replicas: int = 2, **options):
    """A real uvicorn server in a thread, its app's decoder `ScaledEngine` on ``replicas`` Ray
    actors (``options``: `ReplicaSpec` fields)."""
    from recap.serve.scale import ReplicaSpec, scaled_engine_factory

    spec = ReplicaSpec(model=MODEL, cost_profile=fixed_cost_profile(), threads=1, method="recap",
                       memory_dir=str(folder), **{"max_batch": 4, **options})
    make_engine = scaled_engine_factory(spec, replicas, cpus_per_replica=0.5)
    import ray  # only now: `connect` imported it first
    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
    app = create_app(load_target(MODEL), ServerConfig(model_name=MODEL, api_keys={**KEYS, **FRESH},
                                                      memory_dir=str(folder)),
                     make_engine)
    with running(app) as url:
        yield url, app
    assert not ray.is_initialized()  # the engine's shutdown stopped the Ray it started


def _started(stream):
    """The stream's chunk iterator, read up to its first piece of text (decoding has begun)."""
    chunks = iter(stream)
    part = next(chunks)
    while not (part.choices and part.choices[0].delta.content):
        part = next(chunks)
    return chunks


def _client(url: str, tenant: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=f"key-of-tenant-{tenant:02d}", max_retries=0, timeout=120)


def _ask(url: str, tenant: int, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS) -> tuple[str, int]:
    """(text, accepted drafts) of one answer."""
    client = _client(url, tenant)
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens)
        return answer.choices[0].message.content, answer.model_extra["recap"]["accepted_tokens"]
    text, accepted = "", 0
    for part in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True,
                                               stream_options={"include_usage": True}):
        if part.choices:
            text += part.choices[0].delta.content or ""
        if part.usage is not None:
            accepted = part.model_extra["recap"]["accepted_tokens"]
    return text, accepted


def test_without_the_lock_replicas_lose_updates(tmp_path):
    """The negative control (first, before the module's server starts its own Ray): one
    tenant's burst forced onto both replicas (one lane each) with the file lock off loses
    updates, so the exact counts below can fail."""
    with scaled_server(tmp_path, replicas=2, max_batch=1, use_lock=False) as (url, app):
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: _ask(url, 0, PROMPTS[i % 4], False), range(8)))
        loads = [s["requests"] for s in _stats(app.state.engine)]
    assert all("tenant-0" in served for served in loads)  # both replicas decoded the tenant
    assert _counts(tmp_path)["tenant-0"] < 8


def _stats(engine) -> list[dict]:
    import ray

    return ray.get([control(handle, "stats").remote() for handle in engine.handles.values()])


@pytest.fixture(scope="module")
def greedy() -> dict[str, str]:
    return {prompt: _greedy_text(MODEL, prompt, max_tokens=MAX_TOKENS) for prompt in PROMPTS}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("memories")
    with scaled_server(folder) as (url, app):
        yield url, app, folder


def _counts(folder) -> dict[str, int]:
    counts = {}
    for tenant in KEYS.values():
        metadata = memory_metadata(folder / f"{tenant}.safetensors")
        counts[tenant] = int(metadata[REQUESTS_KEY]) if metadata else 0
    return counts


def test_two_replicas_answer_like_greedy_and_count_every_tenants_requests(server, greedy):
    url, app, folder = server
    engine = app.state.engine
    health = httpx.get(f"{url}/health").json()
    assert health["replicas"] == 2 and health["max_batch"] == 8
    # the same API as the single server: keys, errors
    response = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": []},
                          headers={"Authorization": "Bearer wrong-key-123"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"

    # 4 tenants x 8 requests from 8 clients, streamed and not; then a burst of 8 of tenant-0
    # alone, which the load bound spills onto the other replica: 40 requests
    cases = [(t, PROMPTS[(t + i) % 4], i % 2 == 0) for i in range(8) for t in range(4)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda case: (case, _ask(url, *case)), cases))
    # more than a replica's 4 lanes at once: the burst spills. Long answers, so all 8 are in
    # flight together however slowly the clients start (12-token ones could finish first).
    with ThreadPoolExecutor(8) as pool:
        burst = list(pool.map(lambda i: ((0, PROMPTS[i % 4], False), _ask(url, 0, PROMPTS[i % 4], False, LONG)),
                              range(8)))
    for (_, prompt, _), (text, _) in answers:
        assert text == greedy[prompt]
    long = {prompt: _greedy_text(MODEL, prompt, max_tokens=LONG) for prompt in PROMPTS}
    for (_, prompt, _), (text, _) in burst:
        assert text == long[prompt]
    assert sum(accepted for _, (_, accepted) in answers + burst) > 0  # drafts were accepted, and exact

    expected = {t: 8 for t in KEYS.values()}
    expected["tenant-0"] += 8
    assert _counts(folder) == expected  # every request of every tenant is in its file, once
    stats = _stats(engine)
    assert all(s["requests"] for s in stats)  # both replicas decoded
    assert all("tenant-0" in s["requests"] for s in stats)  # the burst spilled onto both
    metrics = httpx.get(f"{url}/metrics").text
    assert 'recap_requests_total{status="ok"} 40.0' in metrics

    # a client that goes away mid-stream frees its replica (the cancel crosses to the replica)
    stream = _client(url, 2).chat.completions.create(model=MODEL, max_tokens=400, stream=True,
                                                     messages=[{"role": "user", "content": PROMPTS[2]}])
    _started(stream)
    stream.close()
    deadline = time.monotonic() + 20
    while httpx.get(f"{url}/health").json()["busy"]:
        assert time.monotonic() < deadline, "the cancelled request kept its replica busy"
        time.sleep(0.05)
    assert 'recap_requests_total{status="499"} 1.0' in httpx.get(f"{url}/metrics").text


def test_a_tenant_never_sees_another_tenants_memory(server, greedy):
    """As on the single server: two fresh tenants asking the same questions, one before and one
    after another tenant's burst (on whichever replicas), end with the same output store, and
    neither's requests touch another tenant's file."""
    from recap.core.persistence import read_token_memory

    url, _, folder = server
    questions = PROMPTS[:2]
    for prompt in questions:
        assert _ask(url, 4, prompt, False)[0] == greedy[prompt]
    first = (folder / "tenant-4.safetensors").read_bytes()
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: _ask(url, 0, PROMPTS[(i + 2) % 4], False), range(6)))
    others = {t: (folder / f"{t}.safetensors").read_bytes() for t in ("tenant-0", "tenant-4")}
    for prompt in questions:
        assert _ask(url, 5, prompt, False)[0] == greedy[prompt]
    assert {t: (folder / f"{t}.safetensors").read_bytes() for t in others} == others
    assert first == others["tenant-4"]
    store = {t: read_token_memory(folder / f"{t}.safetensors").store.tolist() for t in ("tenant-4", "tenant-5")}
    assert store["tenant-4"] and store["tenant-4"] == store["tenant-5"]
    assert read_token_memory(folder / "tenant-0.safetensors").store.tolist() != store["tenant-5"]


def test_a_replica_killed_mid_load_fails_no_non_streamed_request(server, greedy):
    """SIGKILL the replica that streams a long answer while 16 non-streamed requests of every
    tenant are in flight: the stream ends with an error event, every non-streamed request is
    answered like greedy (those the dead replica held run again on the survivor), no memory
    file is torn (each loads, its count never falls), and the survivor serves every tenant."""
    import ray

    from recap.core.persistence import read_token_memory

    url, app, folder = server
    engine = app.state.engine
    before = _counts(folder)
    victim = engine.router.owner("tenant-1")
    stream = _client(url, 1).chat.completions.create(model=MODEL, max_tokens=1000, stream=True,
                                                     messages=[{"role": "user", "content": PROMPTS[0]}])
    chunks = _started(stream)
    cases = [(t, PROMPTS[(t + i) % 4]) for i in range(4) for t in range(4)]
    long = {prompt: _greedy_text(MODEL, prompt, max_tokens=LONG) for prompt in PROMPTS}
    with ThreadPoolExecutor(8) as pool:
        pending = [pool.submit(_ask, url, t, prompt, False, LONG) for t, prompt in cases]
        deadline = time.monotonic() + 20
        while engine.router.loads.get(victim, 0) < 3:  # the stream and non-streamed requests on it
            assert time.monotonic() < deadline, "no request reached the replica to be killed"
            time.sleep(0.01)
        time.sleep(0.5)  # they are decoding: their text has started inside the replica
        os.kill(ray.get(control(engine.handles[victim], "info").remote())["pid"], signal.SIGKILL)
        with pytest.raises(openai.APIError, match="replica"):
            for _ in chunks:
                pass
        answers = [future.result() for future in pending]  # none raises
    for (_, prompt), (text, _) in zip(cases, answers):
        assert text == long[prompt]
    assert victim in engine.dead and engine.retried >= 1

    with ThreadPoolExecutor(4) as pool:  # the survivor serves every tenant afterwards
        after_kill = list(pool.map(lambda t: _ask(url, t, PROMPTS[t], False), range(4)))
    assert [text for text, _ in after_kill] == [greedy[PROMPTS[t]] for t in range(4)]
    health = httpx.get(f"{url}/health").json()
    assert health["replicas"] == 1 and health["replicas_dead"] == 1
    after = _counts(folder)
    for tenant in KEYS.values():  # whole files, none lost; at most the requests made were added
        read_token_memory(folder / f"{tenant}.safetensors")
        assert before[tenant] <= after[tenant] <= before[tenant] + 4 + 1 + (tenant == "tenant-1")

