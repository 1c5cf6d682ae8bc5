"""`recap.serve.shared`: tenant memories shared by processes through file locks and versions
(no Ray: the replicas here are forked processes running the replica's own request path,
`locked_events` over an `Engine`, on the tiny model).

The negative control runs the same requests without the lock and must lose updates: the
test can tell a broken protocol from a working one.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import threading
import time

import pytest

from recap.serve.engine import Engine, Job
from recap.serve.shared import (
    REQUESTS_KEY,
    VERSION_KEY,
    SharedTenantStreams,
    TenantBusy,
    file_version,
    locked_events,
    memory_metadata,
    remove_old_temporaries,
)
from tests.conftest import load_target

PROMPTS = ["Count to five.", "Name a colour.", "Say hello.", "What is two plus two?"]


def _request(engine: Engine, tenants: SharedTenantStreams, tenant: str, prompt: str, pause: float = 0.0,
             request_id: str | None = None) -> dict:
    """One request through the replica's path; ``pause``: seconds between taking the lock and
    queueing (widens the window in which another process could interleave); ``request_id``:
    the id the front gives every attempt of one request."""
    target = engine.target
    job = Job(tenant=tenant, inputs=target.prepare(prompt, None), max_tokens=6, emit=lambda event: None)
    job.request_id = request_id  # set, not passed: the old code's Job has no such field (its tests fail, not error)
    if pause:
        original = tenants._sync_with_file

        def slow_sync(name: str) -> None:
            original(name)
            time.sleep(pause)

        tenants._sync_with_file = slow_sync
    try:
        events = list(locked_events(engine, tenants, job))
    finally:
        tenants.__dict__.pop("_sync_with_file", None)
    assert events[-1]["type"] == "done", events[-1]
    return events[-1]


REQUESTS = 3
"""Requests of the one shared tenant per process and phase."""


def _replica(folder: str, start, results) -> None:
    """A spawned 'replica': its own model, streams and engines on the shared folder; first
    with the lock (tenant ``locked``), then, as the negative control, without (``unlocked``)."""
    import torch

    torch.set_num_threads(1)
    target = load_target("tiny-llama")
    out = {}
    for phase, use_lock in (("locked", True), ("unlocked", False)):
        tenants = SharedTenantStreams("recap", target.vocab_size, folder, 4096, use_lock=use_lock)
        engine = Engine(target, tenants, max_batch=1)
        _request(engine, tenants, f"warm-up-{phase}", PROMPTS[0])  # compiled kernels before the race starts
        start.wait(120)
        texts = [_request(engine, tenants, phase, PROMPTS[i % len(PROMPTS)], pause=0.3)["text"]
                 for i in range(REQUESTS)]
        engine.shutdown(10)
        out[phase] = (tenants.reloads, texts)
    results.put(out)


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
    """Two processes on one folder, both sending one tenant's requests at the same moments."""
    folder = tmp_path_factory.mktemp("shared")
    context = multiprocessing.get_context("spawn")  # fork is unsafe once torch's OpenMP runs
    start, results = context.Barrier(2), context.Queue()
    children = [context.Process(target=_replica, args=(str(folder), start, results)) for _ in range(2)]
    for child in children:
        child.start()
    out, deadline = [], time.monotonic() + 240
    try:
        while len(out) < 2:
            assert time.monotonic() < deadline, "the replicas did not finish"
            assert all(c.is_alive() or c.exitcode == 0 for c in children), [c.exitcode for c in children]
            with contextlib.suppress(queue.Empty):
                out.append(results.get(timeout=0.5))
        for child in children:
            child.join(30)
            assert child.exitcode == 0
    finally:
        for child in children:
            if child.is_alive():
                child.kill()
    return folder, out


def test_two_processes_never_lose_a_tenants_update(two_replicas):
    folder, out = two_replicas
    metadata = memory_metadata(folder / "locked.safetensors")
    assert metadata[REQUESTS_KEY] == str(2 * REQUESTS) and file_version(metadata) == 2 * REQUESTS
    # the two alternated (the lock is handed over while the other waits): each switch is a reload
    assert sum(o["locked"][0] for o in out) >= 1
    greedy = {_greedy(p) for p in PROMPTS[:REQUESTS]}
    assert all(text in greedy for o in out for text in o["locked"][1])


def test_without_the_lock_updates_are_lost(two_replicas):
    """The negative control: the same requests without the lock lose updates."""
    folder, _ = two_replicas
    metadata = memory_metadata(folder / "unlocked.safetensors")
    assert int(metadata[REQUESTS_KEY]) < 2 * REQUESTS  # so the check above can fail


def _greedy(prompt: str) -> str:
    from recap.decoding import decode
    from recap.proposers import make_proposer

    target = load_target("tiny-llama")
    result = decode(target, make_proposer("ar"), target.prepare(prompt, None), max_new_tokens=6)
    return target.tokenizer.decode(result.tokens, skip_special_tokens=True)


def test_a_held_tenant_blocks_another_holder_until_saved_and_released(tmp_path):
    """Two stream sets in one process stand for two replicas (flock locks of two open files
    conflict within a process too): B waits while A holds, then reloads A's save."""
    target = load_target("tiny-llama")
    a = SharedTenantStreams("recap", target.vocab_size, tmp_path, 4096)
    b = SharedTenantStreams("recap", target.vocab_size, tmp_path, 4096)
    engine_a, engine_b = Engine(target, a, max_batch=1), Engine(target, b, max_batch=1)
    try:
        _request(engine_b, b, "t", PROMPTS[0])  # B has a copy at version 1
        assert b.versions["t"] == 1 and b.requests["t"] == 1
        a.hold("t")
        a.hold("t")  # a second request of the same process shares the hold
        with pytest.raises(TenantBusy):
            b.hold("t", deadline=time.monotonic() + 0.2)
        cancelled = threading.Event()
        cancelled.set()
        with pytest.raises(TenantBusy):
            b.hold("t", cancelled=cancelled)
        assert a.versions["t"] == 1 and a.requests["t"] == 1  # loaded B's file
        a.release("t")
        a.release("t")
        with pytest.raises(RuntimeError):
            a.release("t")
        _request(engine_a, a, "t", PROMPTS[1])
        assert file_version(memory_metadata(tmp_path / "t.safetensors")) == 2
        _request(engine_b, b, "t", PROMPTS[2])  # B's copy (version 1) is stale: it reloads first
        assert b.reloads == 1 and b.versions["t"] == 3 and b.requests["t"] == 3
        metadata = memory_metadata(tmp_path / "t.safetensors")
        assert metadata[VERSION_KEY] == "3" and metadata[REQUESTS_KEY] == "3"
        assert metadata["format"] == "recap-token-memory"  # the file's own fields are kept
        _request(engine_b, b, "t", PROMPTS[0])  # its own save is current: no reload
        assert b.reloads == 1
    finally:
        engine_a.shutdown(5)
        engine_b.shutdown(5)
    # nothing is saved at shutdown (it could overwrite a newer file): the version stays
    assert file_version(memory_metadata(tmp_path / "t.safetensors")) == 4


def test_a_failed_save_makes_the_next_hold_reload_the_file(tmp_path, monkeypatch):
    """A's save of version 1 fails (written by the saver thread after the decoder counted it);
    B then saves its own version 1. A's next request must reload that file rather than take
    its copy (also "version 1", but without B's request) for current and save over B's."""
    import recap.core.persistence as persistence
    from recap.serve.shared import STALE

    target = load_target("tiny-llama")
    a = SharedTenantStreams("recap", target.vocab_size, tmp_path, 4096)
    b = SharedTenantStreams("recap", target.vocab_size, tmp_path, 4096)
    engine_a, engine_b = Engine(target, a, max_batch=1), Engine(target, b, max_batch=1)
    real, calls = persistence.write_private, []

    def failing_once(filename, data):
        calls.append(filename)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        real(filename, data)

    monkeypatch.setattr(persistence, "write_private", failing_once)
    try:
        _request(engine_a, a, "t", PROMPTS[0])
        assert a.versions["t"] == STALE and memory_metadata(tmp_path / "t.safetensors") is None
        _request(engine_b, b, "t", PROMPTS[1])
        assert file_version(memory_metadata(tmp_path / "t.safetensors")) == 1
        _request(engine_a, a, "t", PROMPTS[2])
        assert a.reloads == 1 and a.requests["t"] == 2
        metadata = memory_metadata(tmp_path / "t.safetensors")
        assert metadata[VERSION_KEY] == "2" and metadata[REQUESTS_KEY] == "2"  # B's request and A's second
    finally:
        engine_a.shutdown(5)
        engine_b.shutdown(5)


def test_old_temporaries_go_and_recent_ones_stay(tmp_path):
    import os

    old, new = tmp_path / ".a.safetensors.tmp-1-2-abcd1234", tmp_path / ".b.safetensors.tmp-99999999-1-cdcd1234"
    tenant = tmp_path / "c.tmp-1-2-abcd1234.safetensors"  # a tenant's file, however old, is no temporary
    tenant.write_bytes(b"x")
    os.utime(tenant, (time.time() - 7200, time.time() - 7200))
    old.write_bytes(b"x")
    new.write_bytes(b"x")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert remove_old_temporaries(tmp_path) == [old.name]
    assert new.exists() and tenant.exists()  # a writer on another machine may still be saving it
    assert memory_metadata(tmp_path / "missing.safetensors") is None
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    assert memory_metadata(tmp_path / "bad.safetensors") == {}
    assert file_version(None) == 0 and file_version({VERSION_KEY: "x"}) == -1


def test_a_request_the_file_lists_is_answered_but_learned_from_once(tmp_path, monkeypatch):
    """A replica that died between its save and its last event: the front runs the request
    again (same id) on another replica, which answers it identically but learns nothing (the
    file's count, version and bytes stay); a new id counts. The negative control, without
    the id check, counts the repeat twice."""
    import numpy as np

    target = load_target("tiny-llama")
    a = SharedTenantStreams("recap", target.vocab_size, tmp_path, 4096)
    b = SharedTenantStreams("recap", target.vocab_size, tmp_path, 4096)
    engine_a, engine_b = Engine(target, a, max_batch=1), Engine(target, b, max_batch=1)
    path = tmp_path / "t.safetensors"
    try:
        first = _request(engine_a, a, "t", PROMPTS[0], request_id="r1")
        metadata = memory_metadata(path)
        assert (metadata[VERSION_KEY], metadata[REQUESTS_KEY]) == ("1", "1")
        saved = path.read_bytes()
        again = _request(engine_b, b, "t", PROMPTS[0], request_id="r1")  # B reloads A's file: it lists r1
        assert again["text"] == first["text"]
        assert memory_metadata(path)[REQUESTS_KEY] == "1"  # the old code counted r1 twice
        assert path.read_bytes() == saved and b.versions["t"] == 1 and b.requests["t"] == 1
        from recap.serve.shared import LEARNED_KEY, learned_ids

        assert learned_ids(metadata) == ["r1"]
        fresh = SharedTenantStreams("recap", target.vocab_size, tmp_path, 4096)
        fresh.hold("t")  # the file as a replica loads it
        fresh.release("t")
        kept, loaded = b.streams["t"].memory_snapshot().tensors, fresh.streams["t"].memory_snapshot().tensors
        assert all(np.array_equal(kept[name], array) for name, array in loaded.items())  # nothing merged back
        _request(engine_b, b, "t", PROMPTS[0], request_id="r1")  # again, on B's own current copy
        assert path.read_bytes() == saved
        _request(engine_b, b, "t", PROMPTS[1], request_id="r2")  # a new request counts
        metadata = memory_metadata(path)
        assert (metadata[VERSION_KEY], metadata[REQUESTS_KEY], learned_ids(metadata)) == ("2", "2", ["r1", "r2"])
        monkeypatch.setattr(SharedTenantStreams, "learned_from", lambda self, tenant, request_id: False)
        _request(engine_a, a, "t", PROMPTS[0], request_id="r1")  # negative control: without the check
        assert memory_metadata(path)[REQUESTS_KEY] == "3"  # r1 counted twice: the checks above can fail
    finally:
        engine_a.shutdown(5)
        engine_b.shutdown(5)
    many = ",".join(f"id{i}" for i in range(70))
    for hostile in ("", "a,,b", "a b", "r\u00e9", "x" * 5000, many, "r1,"):  # never trusted, never an error
        assert learned_ids({LEARNED_KEY: hostile}) == []
    assert learned_ids(None) == [] and learned_ids({}) == [] and learned_ids({LEARNED_KEY: "a,b-c_9"}) == ["a", "b-c_9"]


def test_a_transient_read_error_refuses_the_request_and_keeps_the_newer_file(tmp_path, monkeypatch):
    """A's copy is at version 0; the file is at version 5. A header read that fails with EIO
    must not read as "version 0" (A would take its copy for current and save version 1 over
    the file): the request is refused (503), the file and A's version untouched, and the next
    request reloads the file."""
    import errno

    from recap.serve import shared
    from recap.serve.tenants import MemoryUnavailable

    target = load_target("tiny-llama")
    a = SharedTenantStreams("recap", target.vocab_size, tmp_path, 4096)
    b = SharedTenantStreams("recap", target.vocab_size, tmp_path, 4096)
    engine_a, engine_b = Engine(target, a, max_batch=1), Engine(target, b, max_batch=1)
    path = tmp_path / "t.safetensors"
    real, failing = shared.file_metadata, []

    def file_metadata(*args, **kwargs):  # the header read (`recap.core.persistence.file_metadata`)
        if failing:
            failing.pop()
            raise OSError(errno.EIO, "Input/output error")
        return real(*args, **kwargs)

    monkeypatch.setattr(shared, "file_metadata", file_metadata)
    try:
        a.hold("t")  # no file yet: A's copy is an empty stream at version 0
        a.release("t")
        assert "t" in a.streams and a.versions["t"] == 0
        _request(engine_b, b, "t", PROMPTS[0])
        b.streams["t"].memory_snapshot().write(path, {VERSION_KEY: "5", REQUESTS_KEY: "5"})
        failing.append(True)
        job = Job(tenant="t", inputs=target.prepare(PROMPTS[1], None), max_tokens=6, emit=lambda event: None)
        events = list(locked_events(engine_a, a, job))
        assert file_version(memory_metadata(path)) == 5  # the old code saved its version 1 over it
        assert [(e["type"], e.get("status")) for e in events] == [("error", 503)] and a.versions["t"] == 0
        failing.append(True)
        with pytest.raises(MemoryUnavailable):
            a.hold("t")
        assert not a.holding("t")
        b.hold("t", deadline=time.monotonic() + 5)  # A let the lock go
        b.release("t")
        _request(engine_a, a, "t", PROMPTS[1])  # the file reads again: A reloads it first
        metadata = memory_metadata(path)
        assert a.reloads == 1 and (metadata[VERSION_KEY], metadata[REQUESTS_KEY]) == ("6", "6")
    finally:
        engine_a.shutdown(5)
        engine_b.shutdown(5)
