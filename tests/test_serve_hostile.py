"""`recap serve` against hostile clients and damaged files (issue 46): each test names what it
caught on the code before its fix."""

from __future__ import annotations

import json
import os
import socket
import stat
import time

import httpx
import numpy as np
import pytest

from recap.core.persistence import MemoryFileError, read_token_memory, save_token_memory, temporary_path
from tests.test_serve import _client, _greedy_text, _metric, _wait_for, serving

CHAT = "/v1/chat/completions"


def _slow_steps(app, seconds: float) -> list[int]:
    """Make every batched step of ``app``'s engine take at least ``seconds`` (so a long answer
    outlasts a client's patience whatever this machine's speed); returns a list whose length
    counts the steps."""
    batch, steps = app.state.engine.batch, []
    step = batch.step

    def slow():
        steps.append(1)
        time.sleep(seconds)
        return step()

    batch.step = slow
    return steps


def test_a_non_streamed_request_whose_client_left_stops_decoding():
    """The decoder stops within a step or two of the hang-up. Before: `_collect` looked for
    the disconnect only after 0.25 s without an event (tens of steps here, and never on a
    model that sends text every step): this test counted 484 steps after it."""
    with serving("tiny-llama", method="ar", max_tokens_limit=4000) as (url, app):
        steps = _slow_steps(app, 0.005)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + CHAT, timeout=httpx.Timeout(30, read=0.5), json={
                "model": "tiny-llama", "max_tokens": 4000, "messages": [{"role": "user", "content": "Go on."}]})
        at_hang_up = len(steps)  # the client's socket is closed now
        _wait_for(lambda: _metric(url, 'recap_requests_total{status="499"}') == 1.0 and not app.state.engine.busy,
                  "the abandoned request kept decoding", timeout=60, interval=0.001)
        assert len(steps) - at_hang_up <= 3, f"{len(steps) - at_hang_up} steps after the client left"
        assert _metric(url, 'recap_requests_total{status="ok"}') == 0
        assert 0 < _metric(url, "recap_abandoned_tokens_total") < 4000  # what the operator sees


def _raw_request(url: str, head: str) -> tuple[int, str]:
    """Send ``head`` (request line and headers, CRLF-separated, no body) on a raw socket:
    httpx would refuse to send these headers. Returns (status, body)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode("latin-1") + b"\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1].decode("latin-1")


@pytest.mark.parametrize("header", ["Host: [", "Host: [::1", "Origin: http://[", "Origin: http://[::1:80"])
def test_a_malformed_host_or_origin_is_a_403_not_a_500(header):
    """Before: ``urlsplit`` raised ValueError on a malformed IPv6 literal: a 500 with a traceback
    in the log."""
    with serving("tiny-llama") as (url, _):
        port = url.rsplit(":", 1)[1]
        host = "" if header.startswith("Host") else f"Host: 127.0.0.1:{port}\r\n"
        status, body = _raw_request(url, f"GET /health HTTP/1.1\r\n{host}{header}\r\nConnection: close")
        assert status == 403, body
        assert json.loads(body)["error"]["code"] == "forbidden_origin"


# ----------------------------------------------------------------------------- memory files
def _memory_file(path, vocab: int = 1000, **tensors) -> None:
    """A version-4 token-memory file whose tensors are the valid defaults below, replaced by
    ``tensors`` (any dtype), with a checksum that matches: what a hostile writer can make."""
    from safetensors.numpy import save_file

    from recap.core.persistence import FORMAT, _checksum

    base = {"keys": np.arange(3, dtype=np.int64), "ids": np.ones((3, 8), np.int64),
            "probs": np.full((3, 8), 0.125, np.float32), "store": np.zeros(0, np.int64),
            "calibration_trials": np.zeros(0), "calibration_accepts": np.zeros(0),
            "seen_tokens": np.arange(3, dtype=np.int64), "seen_requests": np.ones(3, np.int64),
            "calibration_expected": np.zeros(0)}
    base.update(tensors)
    order = ["keys", "ids", "probs", "store", "calibration_trials", "calibration_accepts", "seen_tokens",
             "seen_requests", "calibration_expected"]
    save_file(base, str(path), metadata={"format": FORMAT, "version": "4", "vocab_size": str(vocab),
                                         "top_k": "8", "sha256": _checksum(*(base[name] for name in order))})


def test_a_valid_handmade_file_loads(tmp_path):
    """The control for the refusals below: `_memory_file`'s defaults are a loadable file."""
    _memory_file(tmp_path / "ok.safetensors")
    assert len(read_token_memory(tmp_path / "ok.safetensors").keys) == 3


@pytest.mark.parametrize("case, tensors", [
    ("NaN ids as floats", {"ids": np.full((3, 8), np.nan, np.float32)}),
    ("float keys", {"keys": np.array([0.0, 1.0, 2.0])}),
    ("duplicate keys", {"keys": np.array([5, 5, 6], np.int64)}),
    ("a request count near 2**63", {"seen_requests": np.array([1, 1, 2 ** 63 - 2], np.int64)}),
    ("calibration trials past 2**53", {"calibration_trials": np.array([2.0 ** 60]),
                                       "calibration_accepts": np.array([1.0])}),
], ids=lambda value: value if isinstance(value, str) else "")
def test_a_hostile_memory_file_is_refused(case, tensors, tmp_path):
    """Before: NaN ids stored as floats passed every range check (NaN compares false) and became
    INT64_MIN token ids; float keys, duplicate keys and counters about to overflow all loaded."""
    _memory_file(tmp_path / "m.safetensors", **tensors)
    with pytest.raises(MemoryFileError):
        read_token_memory(tmp_path / "m.safetensors")


def test_a_memory_file_past_the_size_cap_is_not_read(tmp_path, monkeypatch):
    """The size is checked before the body is read. Before: any size was loaded whole."""
    _memory_file(tmp_path / "m.safetensors")
    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda *a, **k: reads.append(a) or real_open(*a, **k))
    with pytest.raises(MemoryFileError, match="more than"):
        read_token_memory(tmp_path / "m.safetensors", max_bytes=100)
    assert not reads


def test_a_memory_file_with_nan_ids_is_moved_aside_and_answers_stay_greedy(tmp_path):
    memory = tmp_path / "memory"
    memory.mkdir()
    _memory_file(memory / "default.safetensors", vocab=load_vocab(), ids=np.full((3, 8), np.nan, np.float32))
    with serving("tiny-llama", memory_dir=str(memory)) as (url, _):
        reply = _client(url).chat.completions.create(model="tiny-llama", max_tokens=8,
                                                     messages=[{"role": "user", "content": "Hello"}])
        assert reply.choices[0].message.content == _greedy_text("tiny-llama", "Hello", None, 8)
    assert any(p.name.startswith("default.safetensors.unreadable-") for p in memory.iterdir())


def load_vocab() -> int:
    from tests.conftest import load_target

    return load_target("tiny-llama").vocab_size


def test_the_memory_folder_and_files_are_private_whatever_the_umask(tmp_path):
    """Before: the folder took the umask's 0755 (every local user could list the tenants) and
    the files' mode was whatever the writer library chose."""
    from recap.serve.tenants import TenantStreams

    old = os.umask(0)
    try:
        shared = tmp_path / "memory"
        shared.mkdir(mode=0o777)
        tenants = TenantStreams("recap", load_vocab(), shared)
        assert stat.S_IMODE(shared.stat().st_mode) == 0o700
        save_token_memory(shared / "alice.safetensors", np.arange(2), np.ones((2, 8)), np.full((2, 8), 0.125),
                          vocab_size=1000)
        assert stat.S_IMODE((shared / "alice.safetensors").stat().st_mode) == 0o600
        assert tenants.memory_dir == shared
    finally:
        os.umask(old)


def test_a_tenant_named_like_a_temporary_keeps_its_file(tmp_path):
    """Before: ``x.tmp-99999-a.safetensors`` matched the temporaries' pattern and was deleted at
    start-up (no process 99999); temporaries are hidden now, which no tenant's file can be."""
    from recap.serve.tenants import TenantStreams

    memory = tmp_path / "memory"
    memory.mkdir()
    kept = memory / "x.tmp-99999-a.safetensors"
    _memory_file(kept)
    stale = memory / os.path.basename(temporary_path(memory / "bob.safetensors")).replace(str(os.getpid()), "99999", 1)
    stale.write_bytes(b"half a save")
    TenantStreams("recap", 1000, memory)
    assert kept.exists() and not stale.exists()


def test_a_transient_read_error_refuses_the_request_and_leaves_the_file(tmp_path, monkeypatch):
    """EMFILE while reading a tenant's memory: 503 for that request, the file left in place,
    and the next request loads it. Before: it was moved aside as unreadable and the tenant
    started cold (its next save overwrote what it had learned)."""
    import errno

    import recap.core.persistence as persistence

    memory = tmp_path / "memory"
    memory.mkdir()
    with serving("tiny-llama", memory_dir=str(memory)) as (url, _):  # a real file of this model
        _client(url).chat.completions.create(model="tiny-llama", max_tokens=6,
                                             messages=[{"role": "user", "content": "Hello there"}])
    saved = memory / "default.safetensors"
    assert saved.exists()
    real, failures = persistence.read_token_memory, []

    def flaky(path, *args, **kwargs):
        if not failures:
            failures.append(path)
            raise OSError(errno.EMFILE, "Too many open files")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(persistence, "read_token_memory", flaky)
    with serving("tiny-llama", memory_dir=str(memory)) as (url, app):
        first = httpx.post(url + CHAT, timeout=60, json={"model": "tiny-llama", "max_tokens": 4,
                                                         "messages": [{"role": "user", "content": "Hi"}]})
        assert first.status_code == 503 and "retry" in first.json()["error"]["message"]
        assert sorted(p.name for p in memory.iterdir()) == ["default.safetensors"]
        second = httpx.post(url + CHAT, timeout=60, json={"model": "tiny-llama", "max_tokens": 4,
                                                          "messages": [{"role": "user", "content": "Hi"}]})
        assert second.status_code == 200
        assert app.state.tenants.streams["default"]._pending_memory is None  # installed at that request
    assert failures and sorted(p.name for p in memory.iterdir()) == ["default.safetensors"]


def test_token_recycling_keeps_its_memory_across_a_restart(tmp_path):
    """Before: the tenant loader read every file as a RECAP token memory, so Token
    Recycling's own matrix file was moved aside as unreadable at every restart."""
    memory = tmp_path / "memory"
    with serving("tiny-llama", method="token-recycling", memory_dir=str(memory)) as (url, _):
        _client(url).chat.completions.create(model="tiny-llama", max_tokens=12,
                                             messages=[{"role": "user", "content": "Count to ten."}])
    assert stat.S_IMODE((memory / "default.safetensors").stat().st_mode) == 0o600
    with serving("tiny-llama", method="token-recycling", memory_dir=str(memory)) as (url, app):
        _client(url).chat.completions.create(model="tiny-llama", max_tokens=2,
                                             messages=[{"role": "user", "content": "Hi"}])
        assert app.state.tenants.streams["default"].matrix.rows_written() > 0
    assert sorted(p.name for p in memory.iterdir()) == ["default.safetensors"]


@pytest.mark.parametrize("damage", ["vocabulary", "token range", "dtype"])
def test_a_damaged_adjacency_file_is_refused(damage, tmp_path):
    from safetensors.numpy import load_file, save_file

    from recap.core.adjacency import AdjacencyMatrix

    matrix = AdjacencyMatrix(100, 4)
    matrix.write(np.array([1, 2]), np.array([[3, 4, 5, 6], [7, 8, 9, 10]]))
    path = tmp_path / "m.safetensors"
    matrix.save(path)
    assert AdjacencyMatrix.load(path, fill=0, vocab_size=100).rows_written() == 2  # the control
    if damage == "vocabulary":
        with pytest.raises(MemoryFileError, match="vocabulary"):
            AdjacencyMatrix.load(path, fill=0, vocab_size=99)
        return
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(path))
    if damage == "token range":
        tensors["rows"][0, 0] = 100
    else:
        tensors["tokens"] = tensors["tokens"].astype(np.float64)
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(MemoryFileError, match="inconsistent|dtype"):
        AdjacencyMatrix.load(path, fill=0, vocab_size=100)


# ----------------------------------------------------------------------------- tenants and keys
def test_tenants_differing_only_in_case_and_weak_keys_are_refused(tmp_path):
    """Before: ``Alice`` and ``alice`` got one memory file on a case-insensitive file system,
    and an 8-character key was enough."""
    from recap.errors import InputError
    from recap.serve.tenants import read_api_keys

    keys = tmp_path / "keys"
    keys.write_text("Alice key-of-alice-000001\nalice key-of-alice-000002\n")
    with pytest.raises(InputError, match="differ only in case"):
        read_api_keys(keys)
    keys.write_text("alice short-key-12\n")
    with pytest.raises(InputError, match="at least 16"):
        read_api_keys(keys)
    from recap.serve import ServerConfig, create_app
    from tests.conftest import load_target

    with pytest.raises(InputError, match="differ only in case"):
        create_app(load_target("tiny-llama"), ServerConfig(model_name="tiny-llama", api_keys={
            "key-of-alice-000001": "Alice", "key-of-alice-000002": "alice"}))


def test_a_keys_length_does_not_reach_the_comparison(monkeypatch):
    """Keys are compared as SHA-256 digests: every comparison sees 32 bytes on each side.
    Before: the raw key, whose length `compare_digest` does not hide."""
    import hmac

    from recap.serve import tenants

    lengths = []
    real = hmac.compare_digest
    monkeypatch.setattr(tenants.hmac, "compare_digest", lambda a, b: lengths.append((len(a), len(b))) or real(a, b))
    keys = {"key-of-alice-0000001": "alice", "a-much-longer-key-of-bob-000000002": "bob"}
    assert tenants.tenant_for(keys, "Bearer key-of-alice-0000001") == "alice"
    assert tenants.tenant_for(keys, "Bearer x") is None
    assert lengths and set(lengths) == {(32, 32)}


def test_a_flooding_tenant_gets_its_share_and_the_others_are_still_answered():
    """alice keeps more requests coming than the queue holds, each retried as soon as it is
    refused; bob's request is admitted and answered as greedy decoding would. Before: alice's
    requests held every queue slot and bob got 429 queue_full."""
    import concurrent.futures
    import threading

    keys = {"key-of-alice-0000001": "alice", "key-of-bob-000000002": "bob"}
    with serving("tiny-llama", method="ar", api_keys=keys, max_queue=4, max_batch=1) as (url, app):
        _slow_steps(app, 0.02)
        stop, codes = threading.Event(), []

        def alice(i):
            while not stop.is_set():
                reply = httpx.post(url + CHAT, timeout=120, headers={"Authorization": "Bearer key-of-alice-0000001"},
                                   json={"model": "tiny-llama", "max_tokens": 20,
                                         "messages": [{"role": "user", "content": f"Story {i}"}]})
                codes.append(reply.json()["error"]["code"] if reply.status_code == 429 else reply.status_code)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            flood = [pool.submit(alice, i) for i in range(8)]
            _wait_for(lambda: len(codes) >= 20, "no flood", interval=0.005)
            bob = httpx.post(url + CHAT, timeout=120, headers={"Authorization": "Bearer key-of-bob-000000002"},
                             json={"model": "tiny-llama", "max_tokens": 8,
                                   "messages": [{"role": "user", "content": "Hello"}]})
            stop.set()
            for future in flood:
                future.result()
        assert bob.status_code == 200, bob.text
        assert bob.json()["choices"][0]["message"]["content"] == _greedy_text("tiny-llama", "Hello", None, 8)
        assert 200 in codes and set(codes) == {200, "tenant_share_exceeded"}
        assert app.state.admission.tenant_limit == 2  # half of 4 queue slots + 1 lane


def test_a_second_server_on_one_memory_folder_is_refused(tmp_path):
    """Before: two single-process servers on one --memory-dir each saved over the other's
    files, losing updates silently."""
    from recap.errors import InputError
    from recap.serve.tenants import TenantStreams

    memory = tmp_path / "memory"
    with serving("tiny-llama", memory_dir=str(memory)), \
            pytest.raises(InputError, match="another server is using the memory folder"):
        TenantStreams("recap", 1000, memory)
    TenantStreams("recap", 1000, memory).close()  # the first one let it go at shutdown


def test_one_requests_failure_in_a_shared_step_fails_only_that_request(monkeypatch):
    """bob's lane raises inside the batched forward from his third step on; alice, batched
    with him, is answered as greedy decoding would, and bob gets a 500. Before: the shared
    step's exception failed every request in the batch."""
    import concurrent.futures

    from recap.verifier.fast import FastLane

    real, calls = FastLane.step_rows, {}

    def failing(self, root, tree):
        scope = self.target.prefix_scope
        calls[scope] = calls.get(scope, 0) + 1
        if scope == "bob" and calls["bob"] >= 3:
            raise RuntimeError("a lane's own failure")
        return real(self, root, tree)

    monkeypatch.setattr(FastLane, "step_rows", failing)
    keys = {"key-of-alice-0000001": "alice", "key-of-bob-000000002": "bob"}
    with serving("tiny-llama", method="ar", api_keys=keys, max_batch=4) as (url, app):
        _slow_steps(app, 0.01)

        def ask(key, prompt):
            return httpx.post(url + CHAT, timeout=120, headers={"Authorization": f"Bearer {key}"},
                              json={"model": "tiny-llama", "max_tokens": 24,
                                    "messages": [{"role": "user", "content": prompt}]})

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            alice = pool.submit(ask, "key-of-alice-0000001", "Hello")
            bob = pool.submit(ask, "key-of-bob-000000002", "Hello there")
            alice, bob = alice.result(), bob.result()
        assert alice.status_code == 200, alice.text
        assert bob.status_code == 500 and calls["alice"] > 3  # they shared steps before bob's failed
        assert alice.json()["choices"][0]["message"]["content"] == _greedy_text("tiny-llama", "Hello", None, 24)


# ----------------------------------------------------------------------------- saves and forks
def _job(tenant: str, prompt: str, max_tokens: int = 6):
    """A job on the tiny model and an Event set at its final event (kept in ``job.final``)."""
    from recap.serve.engine import Job
    from tests.conftest import load_target

    finished = __import__("threading").Event()

    def emit(event: dict) -> None:
        if event["type"] in ("done", "error"):
            job.final = event
            finished.set()

    job = Job(tenant=tenant, inputs=load_target("tiny-llama").prepare(prompt, None), max_tokens=max_tokens,
              emit=emit)
    job.finished = finished
    return job


def _outputs(path) -> int:
    """Answers held in a RECAP memory file's output store (each ends with -1)."""
    return int((read_token_memory(path).store == -1).sum())


def test_a_fork_made_before_the_memory_file_is_installed_loses_nothing(tmp_path, monkeypatch):
    """After a restart, the tenant's first request (the stream's own) fails before its prefill
    while its second, a fork of the stream, runs. Before: the file was installed only at the
    stream's own next request (`begin_request`), so the fork drafted from an empty memory, its
    save wrote the stream without the file's rows over the file, and the next request's late
    install reset the output store and calibration the fork shares: its answer was lost."""
    from recap.decoding import Decoding
    from recap.serve.engine import Engine
    from recap.serve.tenants import TenantStreams
    from tests.conftest import load_target

    target = load_target("tiny-llama")
    path = tmp_path / "default.safetensors"
    engine = Engine(target, TenantStreams("recap", target.vocab_size, tmp_path), max_batch=4)
    first = _job("default", "Count to five.")
    engine.submit(first)
    assert first.finished.wait(120) and first.final["type"] == "done"
    engine.shutdown(30)
    before = read_token_memory(path)
    assert _outputs(path) == 1

    tenants = TenantStreams("recap", target.vocab_size, tmp_path)
    assert tenants.stream("default").fork_request().memory_counts()[0] == len(before.keys)  # it drafts from the file
    engine = Engine(target, tenants, max_batch=4)
    real_open, failed = Decoding.open_prefill, []

    def open_prefill(self):
        if not failed and self.proposer is tenants.streams.get("default"):
            failed.append(self)
            raise RuntimeError("the stream's own request fails before it begins")
        return real_open(self)

    monkeypatch.setattr(Decoding, "open_prefill", open_prefill)
    own, fork = _job("default", "Name a colour."), _job("default", "Say hello.")
    with engine._lock:  # both queued at once: the second is taken while the first is in flight
        engine._jobs.extend([own, fork])
        engine._wake.notify()
    assert own.finished.wait(120) and fork.finished.wait(120)
    assert failed and own.final["type"] == "error" and fork.final["type"] == "done"
    later = _job("default", "What is two plus two?")
    engine.submit(later)
    assert later.finished.wait(120) and later.final["type"] == "done"
    engine.shutdown(30)
    after = read_token_memory(path)
    assert set(before.keys.tolist()) <= set(after.keys.tolist())
    assert _outputs(path) == 3  # the first server's answer, the fork's and the later one's


def test_a_slow_memory_save_holds_no_other_tenants_request(tmp_path, monkeypatch):
    """alice's save is stuck in its write until bob's request, sent after it, is answered.
    Before: the decoder wrote alice's file itself at the end of her request, so bob's request
    waited for alice's disk (here the write gave up waiting after 30 s, then bob ran)."""
    import threading

    import recap.core.persistence as persistence
    from recap.serve.engine import Engine
    from recap.serve.tenants import TenantStreams

    real, alice_writing, bob_answered, waits = persistence.write_private, threading.Event(), threading.Event(), []

    def write_private(filename, data):
        if os.path.basename(filename).startswith(".alice."):
            alice_writing.set()
            waits.append(bob_answered.wait(30))  # False: bob was not answered while alice's write waited
        real(filename, data)

    monkeypatch.setattr(persistence, "write_private", write_private)
    engine = Engine(load_target_model(), TenantStreams("recap", load_vocab(), tmp_path), max_batch=4)
    try:
        alice = _job("alice", "Count to five.")
        engine.submit(alice)
        assert alice_writing.wait(120)
        bob = _job("bob", "Say hello.")
        engine.submit(bob)
        assert bob.finished.wait(120) and bob.final["type"] == "done"
        bob_answered.set()
        assert alice.finished.wait(120) and alice.final["type"] == "done"
    finally:
        bob_answered.set()
        engine.shutdown(30)
    assert waits and all(waits)
    assert len(read_token_memory(tmp_path / "alice.safetensors").keys) > 0


def load_target_model():
    from tests.conftest import load_target

    return load_target("tiny-llama")


def _rows(n: int, keys: np.ndarray | None = None):
    """A token-memory snapshot of ``n`` rows (keys 0..n-1 unless given)."""
    from recap.core.persistence import token_memory_snapshot

    keys = np.arange(n) if keys is None else keys
    return token_memory_snapshot(keys, np.ones((n, 8), np.int64), np.full((n, 8), 0.125), vocab_size=1000)


def test_saves_of_one_tenant_are_coalesced_in_order_and_private(tmp_path, monkeypatch):
    """While t's first save is being written, three more of t and one of u come: t's newest
    replaces the two before it, and is written after the first, then u's. The snapshot is a
    copy (changing the arrays it was taken from changes nothing), and the file is 0600
    whatever the umask. Before: there was no saver (every save was written at once, on the
    decoder thread)."""
    import threading

    from safetensors.numpy import load

    import recap.core.persistence as persistence
    from recap.serve.saver import MemorySaver

    real, entered, release, written = persistence.write_private, threading.Event(), threading.Event(), []

    def write_private(filename, data):
        entered.set()
        assert release.wait(30)
        real(filename, data)
        written.append((os.path.basename(filename).split(".")[1], len(load(data)["keys"])))

    monkeypatch.setattr(persistence, "write_private", write_private)
    saver, path = MemorySaver(), tmp_path / "t.safetensors"
    old = os.umask(0)
    try:
        saver.submit("t", path, _rows(1))
        assert entered.wait(30)  # the first one is being written
        keys = np.arange(4)
        newest = _rows(4, keys)
        saver.submit("t", path, _rows(2))
        saver.submit("u", tmp_path / "u.safetensors", _rows(5))
        saver.submit("t", path, _rows(3))
        saver.submit("t", path, newest)
        keys[:] = 999  # the stream goes on changing: the snapshot does not
        release.set()
        assert saver.flush(30)
    finally:
        os.umask(old)
        release.set()
    assert written == [("t", 1), ("t", 4), ("u", 5)]
    assert saver.coalesced == 2 and saver.written == 3 and saver.pending == 0
    assert read_token_memory(path).keys.tolist() == [0, 1, 2, 3]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.safetensors", "u.safetensors"]


def test_a_failed_write_is_logged_in_one_line_and_the_next_save_is_written(tmp_path, monkeypatch, caplog):
    """A full disk, then a writer's bug: each is one log line, and the saver's thread lives on
    to write the next save. Before: there was no saver."""
    import errno
    import logging

    import recap.core.persistence as persistence
    from recap.serve.saver import MemorySaver

    real, calls = persistence.write_private, []

    def write_private(filename, data):
        calls.append(filename)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        if len(calls) == 2:
            raise RuntimeError("a bug in a writer")
        real(filename, data)

    monkeypatch.setattr(persistence, "write_private", write_private)
    saver, path = MemorySaver(), tmp_path / "t.safetensors"
    with caplog.at_level(logging.ERROR, logger="recap.serve"):
        for n in (1, 2, 3):
            saver.submit("t", path, _rows(n))
            assert saver.flush(30)
            assert saver.last_failed("t") == (n < 3)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2 and all(r.exc_info is None and "\n" not in r.getMessage() for r in errors)
    assert "No space left" in errors[0].getMessage() and "could not save" in errors[1].getMessage()
    assert saver.failed == 2 and saver.written == 1
    assert len(read_token_memory(path).keys) == 3
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the failed writes left no temporary


def test_shutdown_writes_every_waiting_save_before_it_lets_the_folder_go(tmp_path, monkeypatch):
    """The request is answered while its save still waits; shutdown writes it (and its own)
    with the folder still locked, and the file loads back as the stream that learned it.
    Before: the request was answered only after its save was written."""
    import threading

    import recap.core.persistence as persistence
    from recap.proposers import make_proposer
    from recap.serve.engine import Engine
    from recap.serve.tenants import TenantStreams

    real, release, locked = persistence.write_private, threading.Event(), []
    tenants = TenantStreams("recap", load_vocab(), tmp_path)

    def write_private(filename, data):
        release.wait(30)
        locked.append(tenants._folder_lock is not None)
        real(filename, data)

    monkeypatch.setattr(persistence, "write_private", write_private)
    engine = Engine(load_target_model(), tenants, max_batch=4)
    job = _job("default", "Count to five.")
    try:
        engine.submit(job)
        assert job.finished.wait(120) and job.final["type"] == "done"
        assert locked == []  # answered, not yet written
        flush = tenants.saver.flush

        def releasing_flush(timeout=None):  # the write goes on only once shutdown waits for it
            release.set()
            return flush(timeout)

        tenants.saver.flush = releasing_flush
    finally:
        engine.shutdown(30)
        release.set()
    assert locked and all(locked) and tenants._folder_lock is None
    stream, loaded = tenants.streams["default"], make_proposer("recap")
    loaded.load_memory(tmp_path / "default.safetensors", vocab_size=load_vocab())
    (keys, ids, probs), (file_keys, file_ids, file_probs) = stream.memory.unigram_arrays(), \
        loaded.memory.unigram_arrays()
    assert len(keys) and np.array_equal(keys, file_keys) and np.array_equal(ids, file_ids)
    assert np.allclose(probs, file_probs, atol=1e-6)  # the file holds them as float32
    assert loaded.store.flat() == stream.store.flat() and len(loaded.store.flat()) > 1


def _blocking_prepare(monkeypatch, target, release):
    """Make ``target.prepare`` wait for ``release`` on prompts holding "slow"; returns the
    list of prompts it was asked to prepare."""
    prepared, prepare = [], target.prepare

    def blocking(messages, image=None):
        text = json.dumps(messages)
        prepared.append(text)
        if "slow" in text:
            assert release.wait(60), "never released"
        return prepare(messages, image)

    monkeypatch.setattr(target, "prepare", blocking)
    return prepared


def _hold_preparation(url: str, monkeypatch):
    """A request ("slow one") that holds the preparation slot until ``release`` is set; returns
    (release, prompts prepared, [its response], its thread) once it is being prepared."""
    import threading

    from tests.conftest import load_target

    release = threading.Event()
    prepared = _blocking_prepare(monkeypatch, load_target("tiny-llama"), release)
    first: list = []
    holder = threading.Thread(target=lambda: first.append(httpx.post(url + CHAT, timeout=60, json={
        "model": "tiny-llama", "max_tokens": 4, "messages": [{"role": "user", "content": "slow one"}]})))
    holder.start()
    _wait_for(lambda: prepared, "the first request was never prepared")
    return release, prepared, first, holder


def test_a_client_that_leaves_while_waiting_to_be_prepared_costs_no_preparation(monkeypatch):
    """One request holds the preparation slot; a second client gives up while it waits for it:
    its request is never prepared nor queued. Before: it was prepared (tokenised, its image
    through the vision tower) once the slot was free, then queued and decoded."""
    with serving("tiny-llama", method="ar") as (url, app):
        release, prepared, first, holder = _hold_preparation(url, monkeypatch)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + CHAT, timeout=httpx.Timeout(30, read=0.5), json={
                "model": "tiny-llama", "max_tokens": 4, "messages": [{"role": "user", "content": "gone one"}]})
        time.sleep(0.5)  # the hang-up reaches the server (it is what is tested, not a speed)
        release.set()
        holder.join(60)
        assert first[0].status_code == 200
        ok = httpx.post(url + CHAT, timeout=60, json={
            "model": "tiny-llama", "max_tokens": 4, "messages": [{"role": "user", "content": "after"}]})
        assert ok.status_code == 200
        assert not any("gone one" in text for text in prepared), prepared
        assert _metric(url, 'recap_requests_total{status="ok"}') == 2.0
        assert _metric(url, 'recap_requests_total{status="499"}') == 0.0  # never queued


def test_a_request_not_prepared_within_the_limit_gets_503(monkeypatch):
    """While one request's preparation takes long, another waiting for the slot past
    ``prepare_timeout`` gets 503 ``prepare_timeout`` with ``Retry-After``; the slow one is
    still answered. Before: it waited for the slot however long that took."""
    with serving("tiny-llama", method="ar", prepare_timeout=0.3) as (url, app):
        release, prepared, first, holder = _hold_preparation(url, monkeypatch)
        try:
            late = httpx.post(url + CHAT, timeout=60, json={
                "model": "tiny-llama", "max_tokens": 4, "messages": [{"role": "user", "content": "waiting"}]})
        finally:
            release.set()
        holder.join(60)
        assert late.status_code == 503, late.text
        assert late.json()["error"]["code"] == "prepare_timeout" and late.headers["retry-after"] == "1"
        assert first[0].status_code == 503  # its own preparation ran past 0.3 s too: dropped, not queued
        assert not any("waiting" in text for text in prepared)


def test_an_image_past_the_image_token_cap_is_refused_before_the_vision_tower(monkeypatch):
    """``max_image_tokens`` 20 on tiny Qwen2.5-VL: a 224x224 image (66 image tokens) gets 400
    ``image_too_large`` and never reaches the vision tower; a 48x40 one (8) is answered as
    greedy decoding answers it. Before: every image the processor took went through the
    vision tower (Qwen2-VL's processor allows about 16k image tokens)."""
    from recap.images import synthetic_image
    from tests.conftest import load_target
    from tests.test_serve import _data_url

    target = load_target("tiny-qwen2.5-vl")
    encoded, encode = [], target.encode_images
    monkeypatch.setattr(target, "encode_images", lambda inputs: encoded.append(1) or encode(inputs))
    with serving("tiny-qwen2.5-vl", method="ar", max_image_tokens=20) as (url, app):
        def ask(image):
            return httpx.post(url + CHAT, timeout=60, json={"model": "tiny-qwen2.5-vl", "max_tokens": 6, "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(image)}},
                                             {"type": "text", "text": "Describe it."}]}]})

        big = ask(synthetic_image(1, 224, 224))
        assert big.status_code == 400 and big.json()["error"]["code"] == "image_too_large", big.text
        assert "66 image tokens" in big.json()["error"]["message"]
        assert not encoded
        small_image = synthetic_image(1, 48, 40)
        small = ask(small_image)
        assert small.status_code == 200, small.text
        assert encoded
        assert small.json()["choices"][0]["message"]["content"] == _greedy_text("tiny-qwen2.5-vl", "Describe it.",
                                                                                small_image, 6)


def test_a_prepared_image_request_keeps_no_pixels():
    """What waits in the queue for an image prompt is its language rows: the pixels went
    through the vision tower once (``encode_images``) and are dropped. Before: every queued
    request also kept its ``pixel_values``."""
    from recap.images import synthetic_image
    from tests.conftest import load_target

    target = load_target("tiny-qwen2.5-vl")
    inputs = target.encode_images(target.prepare("Describe.", synthetic_image(0, 224, 224)))
    assert inputs.language is not None
    assert not any(name.startswith("pixel_values") for name in inputs.extra), list(inputs.extra)


def test_a_flooders_job_near_its_time_limit_is_taken_before_the_fair_pick():
    """The fair pick gives a free lane to the tenant with the fewest requests decoding, so a
    flooding tenant's queued jobs always came last: in the 600 s soak two of them expired in
    the queue (504). Now a job that has waited half its time limit goes first; before that,
    the fair pick stands."""
    import types
    from collections import deque

    from recap.serve.engine import Engine, Job

    now = time.monotonic()

    def job(tenant: str, waited: float) -> Job:
        return Job(tenant=tenant, inputs=None, max_tokens=1, emit=lambda event: None,
                   submitted=now - waited, deadline=now - waited + 10.0)

    flooder, bob = job("mallory", 6.0), job("bob", 1.0)
    engine = types.SimpleNamespace(_jobs=deque([flooder, bob]), _in_flight={"mallory": 3})
    assert Engine._next_job(engine) is flooder  # waited 6 s of its 10: overdue
    young = job("mallory", 1.0)
    engine = types.SimpleNamespace(_jobs=deque([young, bob]), _in_flight={"mallory": 3})
    assert Engine._next_job(engine) is bob  # the fair pick


def test_a_job_that_expired_in_the_queue_gets_no_lane(monkeypatch):
    """One lane, busy for longer than a queued job's time limit: when the lane frees, that job
    is answered 504 without being admitted (no prefill, no step). Before: it was admitted,
    prefilled and stepped once, then stopped."""
    import threading

    from recap.serve.engine import Job
    from tests.conftest import load_target

    with serving("tiny-llama", method="ar", max_batch=1, max_tokens_limit=400) as (url, app):
        engine = app.state.engine
        _slow_steps(app, 0.01)
        admitted, admit = [], engine._admit
        monkeypatch.setattr(engine, "_admit", lambda job: admitted.append(job) or admit(job))
        busy = threading.Thread(target=lambda: httpx.post(url + CHAT, timeout=60, json={
            "model": "tiny-llama", "max_tokens": 40, "messages": [{"role": "user", "content": "Go on."}]}))
        busy.start()
        _wait_for(lambda: engine.busy, "the first request never ran")
        events: list[dict] = []
        late = Job(tenant="default", inputs=load_target("tiny-llama").prepare("Hello"), max_tokens=4,
                   emit=events.append, deadline=time.monotonic() + 0.05)
        app.state.admission.enter("default")  # as the HTTP side does around its submit
        engine.submit(late)
        app.state.admission.leave()
        busy.join(60)
        _wait_for(lambda: events, "the expired job was never answered")
        assert [event["status"] for event in events] == [504]
        assert all(job is not late for job in admitted)


def test_a_version_field_that_is_no_number_of_ours_is_not_a_500():
    """``--replicas``: a memory file's version "²" passes ``str.isdigit`` and fails ``int``;
    before, every request of that tenant was a 500. It reads as version -1 (not ours: the
    file is reloaded), a plain number as itself."""
    from recap.serve.shared import VERSION_KEY, file_version

    assert file_version({VERSION_KEY: "²"}) == -1
    assert file_version({VERSION_KEY: "12"}) == 12
    assert file_version({}) == 0 and file_version(None) == 0


def test_a_failing_finish_callback_does_not_stop_the_decoder(caplog):
    """The report after an answer (metrics, admission) raising once is one log line; the
    next request is still decoded. Before: the exception ended the decoding thread, and
    every later request waited for ever."""
    with serving("tiny-llama", method="ar") as (url, app):
        engine = app.state.engine
        report, failed = engine.on_finish, []

        def failing_once(job, event):
            if not failed:
                failed.append(1)
                raise RuntimeError("a report that fails")
            report(job, event)

        engine.on_finish = failing_once
        for prompt in ("Hello", "Hello again"):
            reply = httpx.post(url + CHAT, timeout=30, json={
                "model": "tiny-llama", "max_tokens": 4, "messages": [{"role": "user", "content": prompt}]})
            assert reply.status_code == 200, reply.text
        assert failed and "answering a finished request failed" in caplog.text
