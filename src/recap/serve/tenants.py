"""Tenants: who may call the server, and each one's own drafting stream and memory file.

A keys file has one ``<tenant> <key>`` pair per line (``#`` starts a comment). A tenant's
stream (its proposer: for RECAP, U, the output store and the calibration) is never shared;
with a memory folder it is saved as ``<tenant>.safetensors`` after each request and at
shutdown (atomic: temporary file, fsync, rename) and loaded at the tenant's first request.
A save copies the stream under the tenant's lock and leaves the writing to a background
thread (`recap.serve.saver.MemorySaver`): a request's memory is on disk within that thread's
lag, and always once `flush` (the shutdown's) returns.
A file that cannot be used is moved aside with one log line and the tenant starts cold.
RECAP's token memory is bounded per tenant (``memory_rows``; least recently seen tokens go).
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
import time
from pathlib import Path

from recap.core.persistence import MemoryFileError, private_folder, remove_stale_temporaries
from recap.errors import InputError, RecapError
from recap.proposers import Proposer, make_proposer
from recap.serve.saver import MemorySaver

log = logging.getLogger("recap.serve")
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""A tenant name names a file (``<tenant>.safetensors``): letters, digits and ``_.-``, at most
64, starting with a letter or digit, so it can never be ``..``, hidden, a path or an option."""
DEFAULT_TENANT = "default"
MIN_KEY_LENGTH = 16
"""API keys are at least this long (``secrets.token_urlsafe(24)`` gives 32 characters)."""


class MemoryUnavailable(RecapError):
    """A tenant's memory file could not be read for a reason that may pass (too many open
    files, an I/O error): the request is refused (503) and the file left as it is, rather
    than moved aside as unusable and overwritten by a cold stream."""


def valid_tenant_name(name: object) -> bool:
    """Whether ``name`` may be a tenant (checked wherever names enter: keys file, ServerConfig,
    and again before a name becomes a path)."""
    return isinstance(name, str) and TENANT_NAME.fullmatch(name) is not None


def distinct_tenants(names: list[str]) -> None:
    """Refuse tenant names that differ only in case: on a case-insensitive file system
    (macOS, Windows) ``Alice`` and ``alice`` would share one memory file."""
    seen: dict[str, str] = {}
    for name in names:
        other = seen.setdefault(name.casefold(), name)
        if other != name:
            raise InputError(f"tenants {other!r} and {name!r} differ only in case: their memory files would be "
                             "one file on a case-insensitive file system")


def strong_key(key: object) -> bool:
    """Whether ``key`` may be an API key: a string of at least `MIN_KEY_LENGTH` printable,
    non-space ASCII characters."""
    return (isinstance(key, str) and len(key) >= MIN_KEY_LENGTH and key.isascii() and key.isprintable()
            and not any(c.isspace() for c in key))


def read_api_keys(path: str | Path) -> dict[str, str]:
    """key -> tenant from a keys file; bad lines are an `InputError` naming the line (never the key)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise InputError(f"cannot read the API keys file {path}: {error.strerror}") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2 or not valid_tenant_name(fields[0]) or not strong_key(fields[1]):
            raise InputError(f"{path}, line {number}: expected '<tenant> <key>' (tenant: letters, digits, '_.-'; "
                             f"key: at least {MIN_KEY_LENGTH} printable ASCII characters)")
        if fields[1] in keys:
            raise InputError(f"{path}, line {number}: this key is already given to another tenant")
        keys[fields[1]] = fields[0]
    if not keys:
        raise InputError(f"the API keys file {path} holds no keys")
    distinct_tenants(list(dict.fromkeys(keys.values())))
    return keys


def tenant_for(keys: dict[str, str] | None, authorization: str | None) -> str | None:
    """The tenant of a ``Bearer`` key (compared in constant time), DEFAULT_TENANT when the
    server has no keys, None when the key is missing or unknown."""
    if keys is None:
        return DEFAULT_TENANT
    scheme, _, credentials = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not credentials.strip():  # the scheme is case-insensitive (RFC 9110)
        return None
    given = hashlib.sha256(credentials.strip().encode()).digest()  # equal lengths: a key's length never leaks
    tenant = None
    for key, name in keys.items():
        if hmac.compare_digest(hashlib.sha256(key.encode()).digest(), given):
            tenant = name
    return tenant


def lock_folder(folder: Path) -> int:
    """An exclusive lock on ``folder`` for this server's life (``flock`` on the folder itself:
    released when the process dies, however it dies), so a second single-process server on the
    same memory folder is refused instead of silently losing the first one's updates (the
    replicas of ``--replicas`` share a folder through per-tenant file locks instead: `shared`).
    Returns the descriptor that holds it."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise InputError(f"another server is using the memory folder {folder.name}: two servers on one folder "
                         "would lose each other's updates (use --replicas to share one)") from None
    return descriptor


class TenantStreams:
    """One proposer per tenant, made (and its memory loaded) at the tenant's first request."""

    def __init__(self, method: str, vocab_size: int, memory_dir: str | Path | None = None,
                 memory_rows: int | None = None):
        self.method = method
        self.memory_rows = memory_rows
        self.vocab_size = vocab_size
        self.memory_dir = Path(memory_dir) if memory_dir is not None else None
        self._folder_lock: int | None = None
        if self.memory_dir is not None:
            private_folder(self.memory_dir)  # 0700: no other local user lists the tenants or reads their files
            self._folder_lock = lock_folder(self.memory_dir)
            stale = remove_stale_temporaries(self.memory_dir)
            if stale:
                log.warning("removed %d temporary file(s) of saves interrupted by a crash", len(stale))
        self.streams: dict[str, Proposer] = {}
        self._locks: dict[str, threading.RLock] = {}
        self._locks_guard = threading.Lock()
        self.saver = MemorySaver()
        """Writes the snapshots `save` takes, off the caller's (the decoder's) thread."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every save handed to the saver is written; False if ``timeout`` passed."""
        return self.saver.flush(timeout)

    def close(self) -> None:
        """Write every save still waiting, then let another server have the memory folder."""
        self.saver.close()
        self._unlock_folder()

    def _unlock_folder(self) -> None:
        if self._folder_lock is not None:
            os.close(self._folder_lock)
            self._folder_lock = None

    def __del__(self) -> None:
        self._unlock_folder()

    def lock(self, tenant: str) -> threading.RLock:
        """The tenant's lock: the decoder holds it while a request changes the stream and every
        save takes it, so a save never reads a stream mid-change and two saves of one tenant
        (after a request, at shutdown) never interleave."""
        with self._locks_guard:
            lock = self._locks.get(tenant)
            if lock is None:
                lock = self._locks[tenant] = threading.RLock()
            return lock

    def path(self, tenant: str) -> Path | None:
        """The tenant's memory file, always directly inside the memory folder."""
        if not valid_tenant_name(tenant):  # a last guard: names are checked where they enter
            raise ValueError(f"invalid tenant name {tenant[:64]!r}" if isinstance(tenant, str) else
                             "a tenant name must be a string")
        return self.memory_dir / f"{tenant}.safetensors" if self.memory_dir is not None else None

    def stream(self, tenant: str) -> Proposer:
        if tenant not in self.streams:
            bounded = self.memory_rows is not None and self.method in ("recap", "recap-paper")
            proposer = make_proposer(self.method, max_memory_rows=self.memory_rows) if bounded \
                else make_proposer(self.method)
            path = self.path(tenant)
            if path is not None and path.exists() and hasattr(proposer, "load_memory"):
                try:  # each proposer checks its own format (dtypes, shapes, ids, counters, size)
                    proposer.load_memory(path, vocab_size=self.vocab_size)
                except OSError as error:  # the file may be fine: leave it, refuse this request
                    raise MemoryUnavailable(f"tenant {tenant}: its memory file could not be read just now "
                                            f"({error.strerror or error}); retry") from None
                except MemoryFileError as error:
                    aside = path.with_name(f"{path.name}.unreadable-{time.strftime('%Y%m%dT%H%M%S')}"
                                           f"-{secrets.token_hex(3)}")  # two in one second keep both
                    path.replace(aside)
                    log.warning("tenant %s: memory file unusable (%s); moved to %s, starting cold",
                                tenant, error, aside.name)
            self.streams[tenant] = proposer
        return self.streams[tenant]

    def save(self, tenant: str, timeout: float | None = None) -> bool:
        """Hand a snapshot of the tenant's memory (if it has a file and anything to save),
        taken under its lock, to the saver, which writes it soon (`flush` waits for it);
        waits ``timeout`` seconds at most for a request in flight (None: as long as it
        takes). False when it gave up: the file then keeps its last save."""
        path, proposer = self.path(tenant), self.streams.get(tenant)
        if path is None or proposer is None or not hasattr(proposer, "memory_snapshot"):
            return True
        lock = self.lock(tenant)
        if not lock.acquire(timeout=-1 if timeout is None else timeout):
            log.warning("tenant %s: a request still uses its stream; its memory file keeps the last save", tenant)
            return False
        try:  # a copy (the stream changes once the lock goes), handed over under the lock: in order
            self.saver.submit(tenant, path, proposer.memory_snapshot())
        except InputError:
            pass  # nothing learned yet
        finally:
            lock.release()
        return True

    def save_request(self, tenant: str, request_id: str | None = None) -> bool:
        """`save` after one of the tenant's requests left the decoder (with its lock held):
        a copy of the memory, written by the saver thread;
        `recap.serve.shared.SharedTenantStreams` also counts the request (``request_id``: its
        id, listed in the file so that the request is learned once) and versions the file."""
        return self.save(tenant)

    def save_all(self, timeout: float | None = None) -> None:
        """`save` every tenant (``timeout`` for each); `flush` waits for the writes."""
        for tenant in list(self.streams):
            self.save(tenant, timeout)
