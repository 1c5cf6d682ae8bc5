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

    from recap.target.base import TargetModel

    real, calls = TargetModel._fast_rows, {}

    def failing(self, root, tree):
        calls[self.prefix_scope] = calls.get(self.prefix_scope, 0) + 1
        if self.prefix_scope == "bob" and calls["bob"] >= 3:
            raise RuntimeError("a lane's own failure")
        return real(self, root, tree)

    monkeypatch.setattr(TargetModel, "_fast_rows", failing)
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
