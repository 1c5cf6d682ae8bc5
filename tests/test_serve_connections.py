"""The connection layer of `recap serve` (`recap.serve.http`) and crash leftovers in the memory
folder: a client that never finishes its headers, or never reads its response, is cut off;
interrupted saves are cleaned."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from recap.core.persistence import remove_stale_temporaries, temporary_path
from recap.serve.http import header_deadline_protocol
from recap.serve.tenants import TenantStreams


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


FLOOD_ENDED = threading.Event()
"""Set when the app's endless /flood stream ends (its client gone)."""


@pytest.fixture
def server(request):
    """A minimal app under uvicorn with the given protocol class; yields its port."""
    app = FastAPI()
    FLOOD_ENDED.clear()

    @app.get("/ping")
    async def ping():
        return {"ok": True}

    @app.get("/flood")
    async def flood():
        async def chunks():
            try:
                while True:
                    yield b"x" * 65536
                    await asyncio.sleep(0)
            finally:
                FLOOD_ENDED.set()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    port = _free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=request.param)
    instance = uvicorn.Server(config)
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    while not instance.started:
        time.sleep(0.01)
    yield port
    instance.should_exit = True
    thread.join(10)


def _closed_by_server(sock: socket.socket, wait: float) -> bool:
    """True if the server closes the connection within ``wait`` seconds (the client sends
    nothing more meanwhile)."""
    sock.settimeout(wait)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


PARTIAL = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthoriza"


@pytest.mark.parametrize("server", [header_deadline_protocol(0.3)], indirect=True)
def test_a_client_that_never_finishes_its_headers_is_cut_off(server):
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.sendall(PARTIAL[:20])
        time.sleep(0.1)
        sock.sendall(PARTIAL[20:])  # trickled: the deadline runs from the opening, not the last byte
        assert _closed_by_server(sock, 10.0)
    with socket.create_connection(("127.0.0.1", server)) as sock:  # silent after connecting
        assert _closed_by_server(sock, 10.0)


@pytest.mark.parametrize("server", [header_deadline_protocol(0.3)], indirect=True)
def test_whole_requests_and_kept_alive_connections_are_served(server):
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.settimeout(10.0)
        for _ in range(2):  # the second request on the same connection, well after the deadline
            sock.sendall(b"GET /ping HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = b""
            while b'{"ok":true}' not in answer:
                answer += sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 200")
            time.sleep(0.5)
        # ... and once a response is complete, the next request's headers have a deadline too.
        sock.sendall(PARTIAL)
        assert _closed_by_server(sock, 10.0)


@pytest.mark.parametrize("server", [H11Protocol], indirect=True)
def test_plain_uvicorn_keeps_such_a_connection_open(server):
    """The negative control: without the deadline the half-sent request is held (what the
    deadline exists for; if uvicorn ever adds a header timeout of its own this says so)."""
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.sendall(PARTIAL)
        assert not _closed_by_server(sock, 1.0)


def _never_reading(port: int) -> socket.socket:
    """A client that asks for the endless stream and then reads nothing (a small receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /flood HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    return sock


@pytest.mark.parametrize("server", [header_deadline_protocol(10.0, write_timeout=0.3)], indirect=True)
def test_a_client_that_never_reads_its_response_is_cut_off(server):
    """Before: the send waited for the client for ever (uvicorn has no write timeout), holding
    the connection and the app's stream long after the request could have ended."""
    with _never_reading(server):
        assert FLOOD_ENDED.wait(10.0), "the stream of a client that reads nothing was never ended"


@pytest.mark.parametrize("server", [H11Protocol], indirect=True)
def test_plain_uvicorn_waits_for_a_client_that_never_reads(server):
    """The negative control: without the write timeout the stream is still held."""
    with _never_reading(server):
        assert not FLOOD_ENDED.wait(1.5)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_temporary_files_of_interrupted_saves_are_removed_at_start(tmp_path):
    memory = tmp_path / "alice.safetensors"
    memory.write_bytes(b"the last good save")
    dead = tmp_path / f".alice.safetensors.tmp-{_dead_pid()}-1-abcd1234"
    dead.write_bytes(b"half a save")
    live = tmp_path / os.path.basename(temporary_path(tmp_path / "bob.safetensors"))  # this process: saving
    live.write_bytes(b"a save in progress")
    other = tmp_path / "notes.tmp-txt"
    other.write_bytes(b"not ours")
    tenant = tmp_path / f"x.tmp-{_dead_pid()}-1-abcd1234.safetensors"  # a tenant's file, however named
    tenant.write_bytes(b"a tenant's memory")
    TenantStreams("pld", vocab_size=100, memory_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([memory.name, live.name, other.name, tenant.name])
    assert remove_stale_temporaries(tmp_path) == []


def test_a_header_timeout_must_be_positive(capsys):
    from recap.cli import main

    assert main(["serve", "--model", "tiny-llama", "--header-timeout", "0"]) == 2
    assert "--header-timeout must be positive" in capsys.readouterr().err


def test_threads_saving_the_same_files_at_once_never_share_a_temporary(tmp_path, monkeypatch):
    """Every atomic save (token memory, adjacency, bench JSON) takes a temporary name of its own:
    with the process id alone, two threads' writes would interleave in one file and one rename
    would fail or publish the other's half-written bytes."""
    import json

    import numpy as np
    from safetensors.numpy import load_file

    from recap.bench.results import write_json_atomic
    from recap.core import adjacency, persistence

    names = []  # the matrix saves' temporaries (`persistence.write_atomically` takes them)
    seen = persistence.temporary_path
    monkeypatch.setattr(persistence, "temporary_path", lambda path: names.append(seen(path)) or names[-1])
    matrix = adjacency.AdjacencyMatrix(vocab_size=32, k=2, fill=-1)
    matrix.table[3] = [4, 5]
    target_json, target_matrix = tmp_path / "results.json", tmp_path / "u.safetensors"
    barrier, errors = threading.Barrier(8), []

    def save(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(5):
                write_json_atomic(target_json, {"writer": i, "rows": list(range(200))})
                matrix.save(target_matrix)
        except Exception as error:  # noqa: BLE001 - collected for the assertion below
            errors.append(error)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(set(names)) == len(names) == 40
    assert json.loads(target_json.read_text())["rows"] == list(range(200))
    assert load_file(str(target_matrix))["tokens"].tolist() == [3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "u.safetensors"]
    assert np.array_equal(adjacency.AdjacencyMatrix.load(target_matrix, fill=-1).table[3], [4, 5])
