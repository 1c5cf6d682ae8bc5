"""Soak test of `recap serve` on loopback: good and hostile traffic, a SIGKILL and a restart.

A real `recap serve` subprocess (two tenants from an API keys file, `--memory-dir` in a
temporary folder) is driven for ``--duration`` seconds by ``--clients`` threads. Each thread
mixes good requests (a handful of fixed prompts, greedy and seeded sampling, streamed, plain
and sent as a chunked body) with hostile ones (bad JSON, wrong types, huge ``max_tokens``,
oversized and chunked bodies, deep nesting, bad images, path-like image URLs, a wrong model,
missing or wrong keys, slow clients that send a body byte by byte and stop, streams dropped
mid-way, non-streamed requests abandoned after 20 ms). A third tenant, ``mallory``, floods:
``--flood-clients`` threads send requests without pause and retry each refusal at once (it
should get 429 ``tenant_share_exceeded``, never take the others' slots). A quarter of the way
in, a hostile memory file (ids stored as float32 NaN, with a valid checksum) is dropped into
the folder for a fourth tenant, ``carol``, whose requests start then: the server must move it
aside and answer her like everyone else. Halfway through the server is SIGKILLed and
restarted on the same memory folder.

Every good answer is compared with the first answer the server gave for that request and with
a reference computed once, in this process, by plain one-token decoding (`--method ar`) of the
same model on the same kernels (`TargetModel.reference_generate`; for seeded sampling the same
`Sampling` through `decode` with the `ar` proposer). Checks (the exit status is 1 if one fails):

- no 5xx answer (an error event inside a stream with type ``server_error`` counts as one);
- every good answer identical to its reference, and every good request answered while the
  server was up;
- every ``*.safetensors`` memory file loadable with `read_token_memory`, right after the kill
  and at the end; no ``*.unreadable-*`` file (a file the server found corrupt) but the planted
  one of ``carol``, moved aside once;
- the flooding tenant refused with ``tenant_share_exceeded`` and answered too (no 5xx), and no
  other tenant's good request refused: none starved;
- the decoder's work for abandoned requests (``recap_abandoned_tokens_total``) reported;
- the restarted server's RSS flat over the second half of its traffic (within 10%: a leak
  grows on, while the working set of four tenants' streams and eight full lanes is reached
  early and stays); its growth since warm-up and the first server's until the kill are
  reported, and RSS is sampled every few seconds (``rss.series`` in the JSON, and a plot,
  ``--plot``);
- SIGTERM at the end exits 0.

Printed: a summary table of status codes by request kind, then the checks; ``--out`` writes
all of it as JSON (with every 5xx, mismatch and unexpected status, and the request behind it).

    taskset -c 1 .venv/bin/python benchmarks/soak.py --duration 60 --out soak.json   # quick run
    .venv/bin/python benchmarks/soak.py [--model tiny-llama] [--duration 600] [--clients 8] [--method recap]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import random
import re
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

TENANTS = {"alice": "soak-key-alice-0001", "bob": "soak-key-bob-000002"}
FLOODER = ("mallory", "soak-key-mallory-003")
"""The tenant that floods: its own key, so its share is bounded by --tenant-share."""
LATE = ("carol", "soak-key-carol-00004")
"""The tenant whose memory file is planted, hostile, before her first request."""
SLOW = ("slowpoke", "soak-key-slowpoke-05")
"""The key slow clients send: the connections they abandon hold requests until the time
limit, so they count against a share of their own, not the good tenants'."""
KEYS = {**TENANTS, FLOODER[0]: FLOODER[1], LATE[0]: LATE[1], SLOW[0]: SLOW[1]}
RSS_LIMIT = 0.10


# ----------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class GoodCase:
    """One fixed good request: its messages, length and (for seeded sampling) options."""

    name: str
    messages: list[dict[str, str]]
    max_tokens: int
    sampling: dict[str, Any] | None = None

    def body(self, model: str, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "messages": self.messages, "max_tokens": self.max_tokens,
                                "stream": stream, **(self.sampling or {"temperature": 0})}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body


GOOD_CASES = [
    GoodCase("sea", [{"role": "user", "content": "Tell me about the sea."}], 32),
    GoodCase("system", [{"role": "system", "content": "You are terse."},
                        {"role": "user", "content": "List three colours."}], 24),
    GoodCase("turns", [{"role": "user", "content": "What is a river?"},
                       {"role": "assistant", "content": "A river is a stream of water."},
                       {"role": "user", "content": "And a lake?"}], 32),
    GoodCase("unicode", [{"role": "user", "content": "Écris une phrase sur les montagnes, 山 et 🌋."}], 32),
    GoodCase("count", [{"role": "user", "content": "Count from one to twenty."}], 48),
    GoodCase("sampled", [{"role": "user", "content": "Tell me about the sea."}], 32,
             {"temperature": 0.8, "top_p": 0.9, "seed": 1234}),
    GoodCase("sampled-k", [{"role": "user", "content": "What is a river?"}], 24,
             {"temperature": 1.0, "top_k": 20, "seed": 7}),
]


@dataclass
class Hostile:
    """A raw HTTP request: what it sends and the statuses a correct server may answer."""

    kind: str
    variant: str
    body: bytes | Callable[[], Iterator[bytes]] | None
    expected: frozenset[int]
    headers: dict[str, str] = field(default_factory=dict)
    method: str = "POST"
    path: str = "/v1/chat/completions"
    auth: bool = True
    may_reset: bool = False  # the server may close the connection before reading the whole body


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` pixels (a decompression bomb's header)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 1024)) + \
        chunk(b"IEND", b"")


def hostile_requests(model: str, max_body: int) -> list[Hostile]:
    """Every hostile request the soak sends (slow clients are separate: they need a raw socket)."""
    user = [{"role": "user", "content": "Hello there."}]

    def js(value: Any) -> bytes:
        return json.dumps(value).encode()

    def good(**extra: Any) -> dict[str, Any]:
        return {"model": model, "messages": user, "max_tokens": 8, **extra}

    def image(url: Any) -> bytes:
        return js({"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]}]})

    bad400 = frozenset({400})
    out = [
        Hostile("bad_json", "truncated", b'{"model": "' + model.encode() + b'", "messages": [', bad400),
        Hostile("bad_json", "not_utf8", b'{"model": "\xff\xfe", "messages": []}', bad400),
        Hostile("bad_json", "nan", b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], '
                                   b'"temperature": NaN}' % model.encode(), bad400),
        Hostile("bad_json", "huge_int", b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], '
                                        b'"max_tokens": 1%s}' % (model.encode(), b"0" * 40), bad400),
        Hostile("bad_json", "empty", b"", bad400),
        Hostile("bad_json", "trailing_data", b'{"model": "x"} {"model": "y"}', bad400),
        Hostile("wrong_types", "messages_string", js({"model": model, "messages": "hi"}), bad400),
        Hostile("wrong_types", "content_int", js({"model": model, "messages": [{"role": "user", "content": 5}]}),
                bad400),
        Hostile("wrong_types", "max_tokens_string", js(good(max_tokens="10")), bad400),
        Hostile("wrong_types", "max_tokens_float", js(good(max_tokens=3.5)), bad400),
        Hostile("wrong_types", "max_tokens_bool", js(good(max_tokens=True)), bad400),
        Hostile("wrong_types", "stream_string", js(good(stream="yes")), bad400),
        Hostile("wrong_types", "role_unknown", js({"model": model, "messages": [{"role": "wizard", "content": "x"}]}),
                bad400),
        Hostile("wrong_types", "model_int", js({"model": 5, "messages": user}), bad400),
        Hostile("wrong_types", "body_list", js([1, 2, 3]), bad400),
        Hostile("wrong_types", "body_string", js("hello"), bad400),
        Hostile("wrong_types", "empty_messages", js({"model": model, "messages": []}), bad400),
        Hostile("wrong_types", "message_not_object", js({"model": model, "messages": ["hi"]}), bad400),
        Hostile("wrong_types", "n_2", js(good(n=2)), bad400),
        Hostile("wrong_types", "top_p_2", js(good(temperature=1, top_p=2)), bad400),
        Hostile("wrong_types", "seed_negative", js(good(temperature=1, seed=-1)), bad400),
        Hostile("wrong_types", "seed_huge", js(good(temperature=1, seed=2 ** 64)), bad400),
        Hostile("wrong_types", "temperature_negative", js(good(temperature=-1)), bad400),
        Hostile("wrong_types", "stream_options_list", js(good(stream=True, stream_options=[1])), bad400),
        Hostile("huge_max_tokens", "1e9", js(good(max_tokens=10 ** 9)), bad400),
        Hostile("huge_max_tokens", "negative", js(good(max_tokens=-5)), bad400),
        Hostile("huge_max_tokens", "zero", js(good(max_tokens=0)), bad400),
        Hostile("huge_max_tokens", "completion_1e6", js({"model": model, "messages": user,
                                                         "max_completion_tokens": 10 ** 6}), bad400),
        Hostile("huge_max_tokens", "long_prompt", js({"model": model, "max_tokens": 8, "messages": [
            {"role": "user", "content": "word " * 6000}]}), frozenset({400, 413})),
        Hostile("oversized_body", "content_length", js({"model": model, "messages": [
            {"role": "user", "content": "x" * (max_body + 1024)}]}), frozenset({413}), may_reset=True),
        Hostile("oversized_body", "chunked", lambda: _chunks(max_body * 2), frozenset({413}), may_reset=True),
        Hostile("deep_nesting", "messages_100k", b'{"model": "%s", "messages": ' % model.encode() + b"[" * 100_000 +
                b"]" * 100_000 + b"}", frozenset({400, 413})),
        Hostile("deep_nesting", "extra_field_40", js(good()).rstrip(b"}") + b', "metadata": ' +
                b'{"a": ' * 40 + b"1" + b"}" * 40 + b"}", bad400),
        Hostile("deep_nesting", "content_list_nested", js({"model": model, "messages": [
            {"role": "user", "content": [[[[[[{"type": "text", "text": "x"}]]]]]]}]}), bad400),
        Hostile("bad_image", "bad_base64", image("data:image/png;base64,@@@@not-base64@@@@"), bad400),
        Hostile("bad_image", "not_an_image", image("data:image/png;base64," + base64.b64encode(b"hello" * 50).decode()),
                bad400),
        Hostile("bad_image", "png_bomb_header", image("data:image/png;base64," +
                                                      base64.b64encode(_png_header(60000, 60000)).decode()),
                frozenset({400, 413})),
        Hostile("bad_image", "text_mime", image("data:text/plain;base64,aGVsbG8="), bad400),
        Hostile("bad_image", "url_not_string", image({"nested": True}), bad400),
        Hostile("bad_image", "two_images", js({"model": model, "max_tokens": 8, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
                bad400),
        Hostile("path_image", "etc_passwd", image("/etc/passwd"), bad400),
        Hostile("path_image", "file_url", image("file:///etc/passwd"), bad400),
        Hostile("path_image", "dotdot", image("../../../../../../etc/shadow"), bad400),
        Hostile("path_image", "home", image("~/.ssh/id_rsa"), bad400),
        Hostile("path_image", "http_loopback", image("http://127.0.0.1:1/health"), bad400),
        Hostile("path_image", "proc_self", image("/proc/self/environ"), bad400),
        Hostile("path_image", "unc", image("\\\\server\\share\\x.png"), bad400),
        Hostile("wrong_model", "gpt4", js({"model": "gpt-4o", "messages": user, "max_tokens": 8}), frozenset({404})),
        Hostile("wrong_model", "path", js({"model": "../../etc/passwd", "messages": user}), frozenset({404})),
        Hostile("wrong_model", "with_image", image("data:image/png;base64,AAAA").replace(
            model.encode(), b"other-model", 1), frozenset({404})),
        Hostile("missing_key", "no_header", js(good()), frozenset({401}), auth=False),
        Hostile("wrong_key", "unknown", js(good()), frozenset({401}), auth=False,
                headers={"Authorization": "Bearer not-a-key-of-anyone"}),
        Hostile("wrong_key", "basic", js(good()), frozenset({401}), auth=False,
                headers={"Authorization": "Basic " + base64.b64encode(b"alice:soak-key-alice-0001").decode()}),
        Hostile("wrong_key", "prefix", js(good()), frozenset({401}), auth=False,
                headers={"Authorization": "Bearer " + TENANTS["alice"][:-1]}),
        Hostile("wrong_key", "models_no_key", None, frozenset({401}), auth=False, method="GET", path="/v1/models"),
        Hostile("wrong_content_type", "text_plain", js(good()), frozenset({415}),
                headers={"Content-Type": "text/plain"}),
        Hostile("wrong_content_type", "form", b"model=x", frozenset({415}),
                headers={"Content-Type": "application/x-www-form-urlencoded"}),
        Hostile("wrong_path", "get_chat", None, frozenset({405}), method="GET"),
        Hostile("wrong_path", "unknown", js(good()), frozenset({404}), path="/v1/completions/../../etc/passwd"),
        Hostile("wrong_path", "nothing", None, frozenset({404}), method="GET", path="/v1/nothing"),
        Hostile("huge_header", "64k_header", js(good()), frozenset({200, 400, 413, 431}), may_reset=True,
                headers={"X-Padding": "p" * 65536}),
        Hostile("huge_header", "1m_header", js(good()), frozenset({400, 413, 431}), may_reset=True,
                headers={"X-Padding": "p" * (1 << 20)}),
        Hostile("huge_header", "many_headers", js(good()), frozenset({200, 400, 413, 431}), may_reset=True,
                headers={f"X-H{i}": "v" for i in range(2000)}),
    ]
    return out


def _complete(data: bytes) -> bool:
    """Whether ``data`` holds a whole HTTP response (headers and a Content-Length body)."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    match = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    return match is None or len(body) >= int(match.group(1))


def _chunks(total: int, size: int = 65536) -> Iterator[bytes]:
    """A body with no Content-Length (sent chunked): the start of valid JSON, then ``total`` bytes."""
    yield b'{"model": "x", "messages": [{"role": "user", "content": "'
    sent = 0
    while sent < total:
        yield b"y" * size
        sent += size
    yield b'"}]}'


# ----------------------------------------------------------------------------- bookkeeping
class Record:
    """Thread-safe counts and findings."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, Counter[str]] = defaultdict(Counter)
        self.server_errors: list[dict[str, Any]] = []
        self.mismatches: list[dict[str, Any]] = []
        self.unexpected: list[dict[str, Any]] = []
        self.good_failures: list[dict[str, Any]] = []
        self.bad_error_bodies: list[dict[str, Any]] = []
        self.latencies: list[float] = []
        self.good_tokens = 0
        self.accepted = 0
        self.drafted = 0

    def count(self, kind: str, outcome: str) -> None:
        with self.lock:
            self.counts[kind][outcome] += 1

    def add(self, bucket: list[dict[str, Any]], item: dict[str, Any], limit: int = 200) -> None:
        """Keep the first ``limit`` findings of a kind (the counts keep the rest)."""
        with self.lock:
            if len(bucket) < limit:
                bucket.append(item)


LEAK = re.compile(r"Traceback|File \"|\b[A-Z]\w*(Error|Exception)\b")
SERVER_PATHS = sorted({str(ROOT), str(Path.home()), sys.prefix, tempfile.gettempdir()}, key=len, reverse=True)


def check_error_body(record: Record, kind: str, variant: str, status: int, text: str) -> None:
    """A 4xx must be an OpenAI-style JSON error without paths, class names or tracebacks."""
    try:
        body = json.loads(text)
        message = body["error"]["message"]
        ok = isinstance(message, str)
    except (ValueError, KeyError, TypeError):
        ok, message = False, text
    if not ok or LEAK.search(str(message)) or any(path in str(message) for path in SERVER_PATHS):
        record.add(record.bad_error_bodies, {"kind": kind, "variant": variant, "status": status,
                                             "body": text[:400]})


# ----------------------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


RSS_EVERY_S = 5.0
"""Seconds between two samples of the server's RSS."""


def sample_rss(server: Server, begin: float, series: list, stop: threading.Event) -> None:
    """Append (seconds since the traffic began, server start number, RSS MiB) every
    `RSS_EVERY_S` while the soak runs; a sample during the restart is skipped."""
    while not stop.wait(RSS_EVERY_S):
        with contextlib.suppress(Exception):  # the server is down (killed, restarting): no sample
            mib = rss_bytes(server.pid) / 2**20
            if mib > 0 and server.proc.poll() is None:  # a killed server's zombie reads 0
                series.append((time.monotonic() - begin, server.starts, mib))


def late_rss_growth(series: list, begin_second: float, end: float) -> float | None:
    """The restarted server's RSS growth over the second half of its traffic: the mean of its
    last three samples over the mean of the three around that half's start (None: too few)."""
    second = [(t, mib) for t, start, mib in series if start == 2 and t <= end]
    middle = begin_second + (end - begin_second) / 2
    before = [mib for t, mib in second if t <= middle][-3:]
    last = [mib for _, mib in second][-3:]
    if len(before) < 3 or len(last) < 3:
        return None
    return statistics.mean(last) / statistics.mean(before) - 1


def plot_rss(series: list, down_s: float, duration: float, path: str) -> None:
    """The server's RSS over the soak, one line per server start (the SIGKILL between)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 3.5))
    for start in sorted({n for _, n, _ in series}):
        points = [(t, mib) for t, n, mib in series if n == start]
        axis.plot([t for t, _ in points], [mib for _, mib in points], marker=".",
                  label="first server" if start == 1 else "after the SIGKILL")
    axis.set_xlabel("seconds since the traffic began")
    axis.set_ylabel("RSS (MiB)")
    axis.set_title(f"recap serve under the soak ({duration:.0f} s of traffic, {down_s:.0f} s down)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def rss_bytes(pid: int) -> int:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RSS")


class Server:
    """`recap serve` as a subprocess, its output appended to a log file."""

    def __init__(self, args: argparse.Namespace, port: int, keys: Path, memory: Path, log: Path):
        self.command = [sys.executable, "-m", "recap.cli", "serve", "--model", args.model, "--port", str(port),
                        "--method", args.method, "--threads", str(args.threads), "--memory-dir", str(memory),
                        "--api-keys", str(keys), "--cost-profile", args.cost_profile, "--kernels", args.kernels,
                        "--request-timeout", str(args.request_timeout), "--max-body-bytes", str(args.max_body_bytes),
                        "--max-tokens-limit", str(args.max_tokens_limit), "--tenant-share", str(args.tenant_share),
                        "--max-batch", str(args.max_batch)]
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        """How many times the server was started (1, then 2 after the SIGKILL)."""

    def start(self, timeout: float = 300.0) -> float:
        """Start and wait for /health; the seconds it took."""
        start = time.monotonic()
        self.starts += 1
        with open(self.log, "a") as log:
            log.write(f"\n===== start {time.strftime('%H:%M:%S')}: {' '.join(self.command)}\n")
            log.flush()
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1",
                                              "PYTHONPATH": str(ROOT / "src")})
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} at start; see {self.log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s")
            time.sleep(0.2)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(60)

    def terminate(self, timeout: float = 90.0) -> int | None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            return None


# ----------------------------------------------------------------------------- the soak
class Soak:
    def __init__(self, args: argparse.Namespace, references: dict[str, str]):
        self.args = args
        self.references = references
        self.first: dict[str, str] = {}
        self.record = Record()
        self.hostile = hostile_requests(args.model, args.max_body_bytes)
        self.url = ""
        self.up = threading.Event()
        self.stop = threading.Event()
        self.down = threading.Event()  # set from the SIGKILL until the restarted server answers
        self.epoch = 0  # bumped at the kill: a request that spans it may fail without blame
        self.tenants = list(TENANTS)
        """Who the good and hostile clients speak for (carol joins once her file is planted)."""
        self.vocab_size = 0

    # -- good requests
    def good(self, client: httpx.Client, rng: random.Random, *, case: GoodCase | None = None,
             mode: str | None = None, tenant: str | None = None) -> None:
        case = case or rng.choice(GOOD_CASES)
        mode = mode or rng.choice(["plain", "stream", "plain", "stream", "chunked", "stream_dropped",
                                   "plain_dropped"])
        tenant = tenant or rng.choice(self.tenants)
        kind = f"good_{mode}"
        body = case.body(self.args.model, mode in ("stream", "stream_dropped"))
        headers = {"Authorization": f"Bearer {KEYS[tenant]}", "Content-Type": "application/json"}
        epoch, start = self.epoch, time.monotonic()
        detail = {"kind": kind, "case": case.name, "tenant": tenant}
        try:
            if mode == "plain":
                response = client.post(f"{self.url}/v1/chat/completions", json=body, headers=headers,
                                       timeout=self.args.request_timeout + 30)
                outcome, text, usage = self._plain(response, kind, detail)
            elif mode == "plain_dropped":  # the client gives up after 20 ms: the decoder should stop
                try:
                    with httpx.Client() as own:
                        response = own.post(f"{self.url}/v1/chat/completions", json=body, headers=headers,
                                            timeout=httpx.Timeout(self.args.request_timeout + 30, read=0.02))
                except httpx.ReadTimeout:
                    self.record.count(kind, "dropped")
                    return
                outcome, text, usage = self._plain(response, kind, detail)
            elif mode == "chunked":
                raw = json.dumps(body).encode()
                parts = [raw[i:i + 7] for i in range(0, len(raw), 7)]
                response = client.post(f"{self.url}/v1/chat/completions", content=iter(parts), headers=headers,
                                       timeout=self.args.request_timeout + 30)
                outcome, text, usage = self._plain(response, kind, detail)
            else:
                outcome, text, usage = self._stream(client, body, headers, kind, detail,
                                                    drop_after=1 if mode == "stream_dropped" else None)
        except httpx.HTTPError as error:
            self._transport(kind, epoch, error, detail, expected=False)
            return
        self.record.count(kind, outcome)
        if outcome != "200":
            if outcome.startswith("5") or outcome == "stream_server_error":
                return  # recorded as a server error already
            self.record.add(self.record.good_failures, {**detail, "outcome": outcome})
            return
        if text is None:  # a stream dropped on purpose
            return
        with self.record.lock:
            self.record.latencies.append(time.monotonic() - start)
            if usage:
                self.record.good_tokens += usage.get("completion_tokens", 0)
        self.compare(case, text, detail)

    def compare(self, case: GoodCase, text: str, detail: dict[str, Any]) -> None:
        first = self.first.setdefault(case.name, text)
        reference = self.references[case.name]
        if text != reference or text != first:
            self.record.add(self.record.mismatches, {**detail, "answer": text, "reference": reference,
                                                     "first_answer": first})

    def _plain(self, response: httpx.Response, kind: str, detail: dict[str, Any]
               ) -> tuple[str, str | None, dict[str, Any] | None]:
        status = str(response.status_code)
        if response.status_code >= 500:
            self.record.add(self.record.server_errors, {**detail, "status": response.status_code,
                                                        "body": response.text[:500]})
            return status, None, None
        if response.status_code != 200:
            return status, None, None
        body = response.json()
        recap = body.get("recap", {})
        with self.record.lock:
            self.record.accepted += recap.get("accepted_tokens", 0)
            self.record.drafted += recap.get("drafted_tokens", 0)
        return status, body["choices"][0]["message"]["content"], body.get("usage")

    def _stream(self, client: httpx.Client, body: dict[str, Any], headers: dict[str, str], kind: str,
                detail: dict[str, Any], drop_after: int | None
                ) -> tuple[str, str | None, dict[str, Any] | None]:
        text, usage, finished, chunks = "", None, False, 0
        with client.stream("POST", f"{self.url}/v1/chat/completions", json=body, headers=headers,
                           timeout=self.args.request_timeout + 30) as response:
            if response.status_code != 200:
                response.read()
                return self._plain(response, kind, detail)
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    if event["error"].get("type") == "server_error":
                        self.record.add(self.record.server_errors, {**detail, "status": "in-stream",
                                                                    "body": payload[:500]})
                        return "stream_server_error", None, None
                    return f"stream_error_{event['error'].get('code')}", None, None
                for choice in event.get("choices", []):
                    text += choice.get("delta", {}).get("content") or ""
                    finished = finished or bool(choice.get("finish_reason"))
                if event.get("usage"):
                    usage = event["usage"]
                    recap = event.get("recap", {})
                    with self.record.lock:
                        self.record.accepted += recap.get("accepted_tokens", 0)
                        self.record.drafted += recap.get("drafted_tokens", 0)
                chunks += 1
                if drop_after is not None and chunks > drop_after:
                    return "200", None, None  # close the connection mid-stream
        if not finished:
            return "stream_unfinished", None, None
        return "200", text, usage

    # -- hostile requests
    def send_hostile(self, client: httpx.Client, request: Hostile, tenant: str) -> None:
        headers = {"Content-Type": "application/json"} if request.method == "POST" else {}
        if request.auth:
            headers["Authorization"] = f"Bearer {KEYS[tenant]}"
        headers.update(request.headers)
        content = request.body() if callable(request.body) else request.body
        epoch = self.epoch
        detail = {"kind": request.kind, "variant": request.variant}
        try:
            response = client.request(request.method, f"{self.url}{request.path}", content=content,
                                      headers=headers, timeout=self.args.request_timeout + 30)
        except httpx.HTTPError as error:
            self._transport(request.kind, epoch, error, detail, expected=request.may_reset)
            return
        self._judge(request.kind, request.variant, response.status_code, response.text, request.expected)

    def _judge(self, kind: str, variant: str, status: int, text: str, expected: frozenset[int]) -> None:
        self.record.count(kind, str(status))
        if status >= 500:
            self.record.add(self.record.server_errors, {"kind": kind, "variant": variant, "status": status,
                                                        "body": text[:500]})
        elif status not in expected:
            self.record.add(self.record.unexpected, {"kind": kind, "variant": variant, "status": status,
                                                     "expected": sorted(expected), "body": text[:300]})
        if 400 <= status < 500:
            check_error_body(self.record, kind, variant, status, text)

    def _transport(self, kind: str, epoch: int, error: Exception, detail: dict[str, Any], *, expected: bool) -> None:
        if epoch != self.epoch or self.down.is_set():
            self.record.count(kind, "killed")  # in flight at the SIGKILL
            return
        name = type(error).__name__
        self.record.count(kind, f"conn:{name}")
        if not expected:
            self.record.add(self.record.good_failures if kind.startswith("good") else self.record.unexpected,
                            {**detail, "outcome": f"transport error {name}: {str(error)[:200]}"})

    # -- slow clients, on a raw socket
    def slow(self, rng: random.Random, tenant: str) -> None:
        """Send the headers and a few body bytes one at a time, then stop: wait for the answer
        (``slow_stop``: the server should give 408 within --request-timeout) or just go
        (``slow_abandon``); ``slow_headers`` stops inside the headers instead."""
        variant = rng.choice(["slow_stop", "slow_abandon", "slow_headers"])
        port = int(self.url.rsplit(":", 1)[1])
        body = json.dumps(GOOD_CASES[0].body(self.args.model, False)).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                f"Authorization: Bearer {SLOW[1]}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        epoch = self.epoch
        wait = self.args.request_timeout + 15
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
                if variant == "slow_headers":
                    for byte in head[:40]:
                        sock.sendall(bytes([byte]))
                        time.sleep(0.05)
                else:
                    sock.sendall(head)
                    for byte in body[:12]:
                        sock.sendall(bytes([byte]))
                        time.sleep(0.1)
                if variant == "slow_abandon":
                    self.record.count(variant, "abandoned")
                    return
                start = time.monotonic()
                data = b""
                with contextlib.suppress(TimeoutError, socket.timeout, ConnectionError):
                    while not _complete(data):
                        more = sock.recv(65536)
                        if not more:
                            break
                        data += more
                took = time.monotonic() - start
        except OSError as error:
            self._transport(variant, epoch, error, {"kind": variant, "variant": variant}, expected=False)
            return
        if not data:
            if epoch != self.epoch or self.down.is_set():
                self.record.count(variant, "killed")
            else:  # closed, or no answer at all within the wait
                outcome = "closed_silently" if took < wait - 1 else "no_answer"
                self.record.count(variant, outcome)
                # A client stuck inside its headers is closed by the server's header deadline
                # (`recap.serve.http`, --header-timeout 10 s): expected, and nothing else is.
                if not (variant == "slow_headers" and outcome == "closed_silently"):
                    self.record.add(self.record.unexpected, {"kind": variant, "variant": variant,
                                                             "outcome": f"{outcome} after {took:.1f} s"})
            return
        status = int(data.split(b" ", 2)[1])
        # 429: its key's share is full of abandoned slow requests (refused before the body: fine)
        expected = frozenset({408, 429}) if variant == "slow_stop" else frozenset({400, 408, 429})
        self._judge(variant, variant, status, data.decode("latin-1").split("\r\n\r\n", 1)[-1], expected)

    # -- the flooding tenant and the late one
    def flood(self, index: int) -> None:
        """Requests from ``mallory`` without pause, each refusal retried at once."""
        body = GOOD_CASES[index % len(GOOD_CASES)].body(self.args.model, False)
        headers = {"Authorization": f"Bearer {FLOODER[1]}", "Content-Type": "application/json"}
        with httpx.Client() as client:
            while not self.stop.is_set():
                if not self.up.wait(0.5):
                    continue
                epoch = self.epoch
                try:
                    response = client.post(f"{self.url}/v1/chat/completions", json=body, headers=headers,
                                           timeout=self.args.request_timeout + 30)
                except httpx.HTTPError as error:
                    self._transport("flood", epoch, error, {"kind": "flood"}, expected=False)
                    client.close()
                    client = httpx.Client()
                    continue
                code = str(response.status_code)
                if response.status_code == 429:
                    code = f"429 {response.json()['error']['code']}"
                    time.sleep(0.01)
                elif response.status_code >= 500:
                    self.record.add(self.record.server_errors, {"kind": "flood", "status": response.status_code,
                                                                "body": response.text[:500]})
                self.record.count("flood", code)

    def plant(self, memory: Path) -> None:
        """Drop a hostile memory file for ``carol`` (float32 NaN ids, valid checksum), then let
        her requests start."""
        import numpy as np
        from safetensors.numpy import save_file

        from recap.core.persistence import FORMAT, _checksum

        tensors = {"keys": np.arange(3, dtype=np.int64), "ids": np.full((3, 8), np.nan, np.float32),
                   "probs": np.full((3, 8), 0.125, np.float32), "store": np.zeros(0, np.int64),
                   "calibration_trials": np.zeros(0), "calibration_accepts": np.zeros(0),
                   "seen_tokens": np.arange(3, dtype=np.int64), "seen_requests": np.ones(3, np.int64),
                   "calibration_expected": np.zeros(0)}
        order = ["keys", "ids", "probs", "store", "calibration_trials", "calibration_accepts", "seen_tokens",
                 "seen_requests", "calibration_expected"]
        save_file(tensors, str(memory / f"{LATE[0]}.safetensors"),
                  metadata={"format": FORMAT, "version": "4", "vocab_size": str(self.vocab_size), "top_k": "8",
                            "sha256": _checksum(*(tensors[name] for name in order))})
        self.tenants = [*TENANTS, LATE[0]]

    # -- the client threads
    def client(self, index: int) -> None:
        rng = random.Random(1000 + index)
        client, epoch = httpx.Client(), self.epoch
        try:
            while not self.stop.is_set():
                if not self.up.wait(0.5):
                    continue
                if epoch != self.epoch:  # its pooled connections went with the killed server
                    client.close()
                    client, epoch = httpx.Client(), self.epoch
                tenant = rng.choice(self.tenants)
                roll = rng.random()
                if roll < 0.5:
                    self.good(client, rng)
                elif roll < 0.55:
                    self.slow(rng, tenant)
                else:
                    request = rng.choice(self.hostile)
                    if request.may_reset:  # a body cut short must not poison the pooled connection
                        with httpx.Client() as own:
                            self.send_hostile(own, request, tenant)
                    else:
                        self.send_hostile(client, request, tenant)
        except Exception as error:  # noqa: BLE001 - a soak bug must be visible, not silent
            self.record.add(self.record.unexpected, {"kind": "soak_client_crash", "outcome": repr(error)})
            raise
        finally:
            client.close()

    def warm_up(self) -> None:
        """Every good request for both tenants, streamed and not, then every hostile one once."""
        with httpx.Client() as client:
            rng = random.Random(0)
            for tenant in TENANTS:
                for case in GOOD_CASES:
                    for mode in ("plain", "stream"):
                        self.good(client, rng, case=case, mode=mode, tenant=tenant)
            for request in self.hostile:
                with httpx.Client() as own:
                    self.send_hostile(own, request, "alice")


def memory_report(folder: Path) -> dict[str, Any]:
    """Every memory file loads; moved-aside and leftover temporary files are listed."""
    from recap.core.persistence import read_token_memory

    files: dict[str, Any] = {}
    for path in sorted(folder.iterdir()):
        if path.name.endswith(".safetensors"):
            try:
                saved = read_token_memory(path)
                files[path.name] = {"ok": True, "rows": len(saved.keys), "bytes": path.stat().st_size}
            except Exception as error:  # noqa: BLE001
                files[path.name] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    others = sorted(p.name for p in folder.iterdir() if not p.name.endswith(".safetensors"))
    unreadable = [name for name in others if ".unreadable-" in name]
    planted = [name for name in unreadable if name.startswith(f"{LATE[0]}.safetensors.")]
    ok = bool(files) and all(f["ok"] for f in files.values()) and len(unreadable) == len(planted) <= 1
    return {"ok": ok, "files": files, "unreadable": unreadable, "planted_moved_aside": len(planted),
            "leftover_temporary": [n for n in others if ".tmp" in n], "other": others}


def compute_references(args: argparse.Namespace) -> tuple[dict[str, str], int]:
    """Plain one-token decoding of every good case, on the server's model and kernels."""
    import torch

    from recap.decoding import decode, reference_generate
    from recap.models import load
    from recap.proposers import make_proposer
    from recap.verifier.sampling import Sampling

    torch.set_num_threads(args.threads)
    target = load(args.model, kernels=args.kernels)
    out = {}
    for case in GOOD_CASES:
        inputs = target.prepare(case.messages)
        if case.sampling is None:
            tokens = reference_generate(target, inputs, case.max_tokens)
        else:
            s = case.sampling
            sampling = Sampling.of(s["temperature"], s.get("top_k"), s.get("top_p"), s.get("seed"))
            tokens = decode(target, make_proposer("ar"), inputs, max_new_tokens=case.max_tokens,
                            sampling=sampling).tokens
        out[case.name] = target.tokenizer.decode(tokens, skip_special_tokens=True)
    return out, target.vocab_size


def _metrics(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Samples of the server's /metrics (absent: 0)."""
    found = dict.fromkeys(names, 0.0)
    with contextlib.suppress(httpx.HTTPError):
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            name, _, value = line.rpartition(" ")
            if name in found:
                found[name] = float(value)
    return found


def log_findings(log: Path) -> dict[str, Any]:
    text = log.read_text(errors="replace")
    tracebacks = [m.start() for m in re.finditer(r"Traceback \(most recent call last\)", text)]
    excerpts = [text[max(0, i - 300):i + 1500] for i in tracebacks[:5]]
    levels = Counter(re.findall(r"^(ERROR|WARNING|CRITICAL):", text, flags=re.M))
    return {"tracebacks": len(tracebacks), "excerpts": excerpts, "levels": dict(levels)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--method", default="recap")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic in all (60 for a quick run)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    parser.add_argument("--kernels", default="auto", choices=["auto", "fast", "stock"])
    parser.add_argument("--cost-profile", default="flat", help="the server's --cost-profile (flat: nothing measured)")
    parser.add_argument("--request-timeout", type=int, default=10,
                        help="the server's --request-timeout: how long a slow client can hold a request")
    parser.add_argument("--max-body-bytes", type=int, default=256 * 1024)
    parser.add_argument("--max-tokens-limit", type=int, default=1024)
    parser.add_argument("--flood-clients", type=int, default=12, help="threads of the flooding tenant")
    parser.add_argument("--tenant-share", type=float, default=0.125,
                        help="the server's --tenant-share (0.125: 9 of 64 queue slots + 8 lanes: above what 8 "
                             "client threads can hold, below the flood)")
    parser.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (log, memories, keys)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--plot", default=None, help="draw the server's RSS over time into this PNG")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="recap-soak-"))
    memory, keys, log = workdir / "memory", workdir / "keys.txt", workdir / "server.log"
    memory.mkdir()
    keys.write_text("# tenant key\n" + "".join(f"{t} {k}\n" for t, k in KEYS.items()))
    print(f"soak: {args.model}, {args.method}, {args.clients} clients, {args.duration:.0f} s; folder {workdir}",
          flush=True)
    started = time.monotonic()
    references, vocab_size = compute_references(args)
    print(f"references computed in {time.monotonic() - started:.1f} s", flush=True)

    soak = Soak(args, references)
    soak.vocab_size = vocab_size
    port = free_port()
    server = Server(args, port, keys, memory, log)
    soak.url = server.url
    result: dict[str, Any] = {"meta": {k: v for k, v in vars(args).items()}, "workdir": str(workdir)}
    rss: dict[str, Any] = {}
    series: list[tuple[float, int, float]] = []
    threads: list[threading.Thread] = []
    exit_status = None
    after_kill: dict[str, Any] = {}
    try:
        result["start_s"] = server.start()
        soak.warm_up()
        rss["first_start"] = rss_bytes(server.pid)
        print(f"server up in {result['start_s']:.1f} s, warmed up; RSS {rss['first_start'] / 2**20:.1f} MiB",
              flush=True)
        begin = time.monotonic()
        sampler = threading.Thread(target=sample_rss, args=(server, begin, series, soak.stop), daemon=True)
        sampler.start()
        soak.up.set()
        threads = [threading.Thread(target=soak.client, args=(i,), daemon=True) for i in range(args.clients)]
        threads += [threading.Thread(target=soak.flood, args=(i,), daemon=True) for i in range(args.flood_clients)]
        for thread in threads:
            thread.start()
        time.sleep(max(0.0, begin + args.duration / 4 - time.monotonic()))
        soak.plant(memory)
        print(f"planted a hostile memory file for {LATE[0]} at {time.monotonic() - begin:.1f} s", flush=True)
        time.sleep(max(0.0, begin + args.duration / 2 - time.monotonic()))

        rss["first_before_kill"] = rss_bytes(server.pid)
        soak.up.clear()
        soak.down.set()
        soak.epoch += 1
        server.kill()
        killed_at = time.monotonic()
        after_kill = memory_report(memory)
        print(f"SIGKILL at {time.monotonic() - begin:.1f} s; memory files after the kill: "
              f"{'all load' if after_kill['ok'] else 'NOT ALL LOAD'} {list(after_kill['files'])}", flush=True)
        result["restart_s"] = server.start()
        soak.down.clear()
        soak.warm_up()
        rss["second_start"] = rss_bytes(server.pid)
        soak.up.set()
        result["down_s"] = time.monotonic() - killed_at  # no client traffic: restart and warm-up
        print(f"restarted in {result['restart_s']:.1f} s; RSS {rss['second_start'] / 2**20:.1f} MiB", flush=True)
        time.sleep(max(0.0, begin + args.duration - time.monotonic()))
        rss["second_end"] = rss_bytes(server.pid)
        soak.stop.set()
        result["traffic_s"] = time.monotonic() - begin - result["down_s"]
        for thread in threads:
            thread.join(args.request_timeout + 60)
        result["hung_clients"] = sum(t.is_alive() for t in threads)
        result["clients_done_s"] = time.monotonic() - begin  # the last requests (slow clients) finish
        rss["second_after_clients"] = rss_bytes(server.pid)
        result["abandoned"] = _metrics(server.url, ("recap_abandoned_tokens_total",
                                                    'recap_requests_total{status="499"}'))
    finally:
        soak.stop.set()
        if server.proc is not None and server.proc.poll() is None:
            exit_status = server.terminate()
    final = memory_report(memory)
    record = soak.record

    first_growth = rss["first_before_kill"] / rss["first_start"] - 1
    second_growth = rss["second_end"] / rss["second_start"] - 1
    late_growth = late_rss_growth(series, begin_second=result.get("down_s", 0.0) + args.duration / 2,
                                  end=args.duration)
    good_total = sum(n for kind, c in record.counts.items() if kind.startswith("good") for n in c.values())
    checks = {
        "no 5xx": len(record.server_errors) == 0,
        "every good answer identical to its reference": len(record.mismatches) == 0,
        "every good request answered while the server was up": len(record.good_failures) == 0,
        "memory files load after the SIGKILL": after_kill.get("ok", False),
        "memory files load at the end": final["ok"],
        f"RSS flat over the restarted server's second half (< {RSS_LIMIT:.0%})":
            late_growth is not None and late_growth < RSS_LIMIT,
        "SIGTERM exits 0": exit_status == 0,
        "the flooding tenant held to its share and answered too":
            record.counts["flood"].get("429 tenant_share_exceeded", 0) > 0 and record.counts["flood"].get("200", 0) > 0
            and set(record.counts["flood"]) <= {"200", "429 tenant_share_exceeded", "killed"},
        "the planted memory file moved aside once, its tenant answered":
            final.get("planted_moved_aside") == 1 and any(key.startswith("good") for key in record.counts),
        "no client thread hung": result.get("hung_clients", 1) == 0,
    }
    result.update({
        "checks": checks, "passed": all(checks.values()),
        "counts": {kind: dict(sorted(c.items())) for kind, c in sorted(record.counts.items())},
        "server_errors": record.server_errors, "mismatches": record.mismatches,
        "good_failures": record.good_failures, "unexpected": record.unexpected,
        "bad_error_bodies": record.bad_error_bodies,
        "good": {"requests": good_total, "compared": len(record.latencies), "completion_tokens": record.good_tokens,
                 "drafted_tokens": record.drafted, "accepted_tokens": record.accepted,
                 "median_latency_s": statistics.median(record.latencies) if record.latencies else None},
        "rss": {**rss, "first_growth": first_growth, "second_growth": second_growth, "late_growth": late_growth,
                "series": [{"s": round(t, 1), "server": n, "mib": round(m, 1)} for t, n, m in series]},
        "memory_after_kill": after_kill, "memory_at_end": final, "sigterm_exit": exit_status,
        "log": log_findings(log), "references": references,
    })

    print(f"\n{'kind':<22} {'total':>6}  outcomes")
    for kind, counter in sorted(record.counts.items()):
        outcomes = ", ".join(f"{o}: {n}" for o, n in sorted(counter.items()))
        print(f"{kind:<22} {sum(counter.values()):>6}  {outcomes}")
    total = sum(sum(c.values()) for c in record.counts.values())
    print(f"{'all':<22} {total:>6}  in {result.get('traffic_s', 0):.0f} s of traffic (+{result.get('down_s', 0):.0f} s "
          f"down for the restart and its warm-up; the last slow client done at "
          f"{result.get('clients_done_s', 0):.0f} s)")
    g = result["good"]
    print(f"\ngood answers compared: {g['compared']}, completion tokens {g['completion_tokens']}, "
          f"accepted drafts {g['accepted_tokens']} of {g['drafted_tokens']} drafted")
    print(f"RSS: first server {rss['first_start'] / 2**20:.1f} -> {rss['first_before_kill'] / 2**20:.1f} MiB "
          f"({first_growth:+.1%}) until the kill; restarted {rss['second_start'] / 2**20:.1f} -> "
          f"{rss['second_end'] / 2**20:.1f} MiB ({second_growth:+.1%}); over its second half "
          f"{'n/a' if late_growth is None else f'{late_growth:+.1%}'}")
    if args.plot:
        plot_rss(series, result.get("down_s", 0.0), args.duration, args.plot)
        print(f"RSS over time: {args.plot}")
    print(f"memory files at the end: {final['files']}; leftover temporary files: {final['leftover_temporary']}; "
          f"moved aside: {final['unreadable']}")
    abandoned = result.get("abandoned", {})
    cancelled = abandoned.get('recap_requests_total{status="499"}', 0)
    print(f"abandoned requests (499) since the restart: {cancelled:.0f}, tokens decoded for requests that ended "
          f"without an answer: {abandoned.get('recap_abandoned_tokens_total', 0):.0f}")
    print(f"server log: {result['log']['tracebacks']} traceback(s), levels {result['log']['levels']}")
    for name, items in (("5xx", record.server_errors), ("mismatch", record.mismatches),
                        ("good failure", record.good_failures), ("unexpected", record.unexpected),
                        ("error body", record.bad_error_bodies)):
        for item in items[:5]:
            print(f"  {name}: {json.dumps(item, ensure_ascii=False)[:400]}")
        if len(items) > 5:
            print(f"  ... {len(items) - 5} more {name}(s) in the JSON")
    print()
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, ensure_ascii=False))
    if not args.keep:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
