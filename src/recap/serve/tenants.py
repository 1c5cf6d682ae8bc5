"""Tenants: who may call the server, and each one's own drafting stream and memory file.

A keys file has one ``<tenant> <key>`` pair per line (``#`` starts a comment). A tenant's
stream (its proposer: for RECAP, U, the output store and the calibration) is never shared;
with a memory folder it is saved as ``<tenant>.safetensors`` after each request and at
shutdown (atomic: temporary file, fsync, rename) and loaded at the tenant's first request.
A file that cannot be used is moved aside with one log line and the tenant starts cold.
RECAP's token memory is bounded per tenant (``memory_rows``; least recently seen tokens go).
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
import threading
import time
from pathlib import Path

from recap.core.persistence import MemoryFileError, read_token_memory, remove_stale_temporaries
from recap.errors import InputError
from recap.proposers import Proposer, make_proposer

log = logging.getLogger("recap.serve")
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""A tenant name names a file (``<tenant>.safetensors``): letters, digits and ``_.-``, at most
64, starting with a letter or digit, so it can never be ``..``, hidden, a path or an option."""
DEFAULT_TENANT = "default"


def valid_tenant_name(name: object) -> bool:
    """Whether ``name`` may be a tenant (checked wherever names enter: keys file, ServerConfig,
    and again before a name becomes a path)."""
    return isinstance(name, str) and TENANT_NAME.fullmatch(name) is not None


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
        if len(fields) != 2 or not valid_tenant_name(fields[0]) or len(fields[1]) < 8:
            raise InputError(f"{path}, line {number}: expected '<tenant> <key>' (tenant: letters, digits, '_.-'; "
                             "key: at least 8 characters)")
        if fields[1] in keys:
            raise InputError(f"{path}, line {number}: this key is already given to another tenant")
        keys[fields[1]] = fields[0]
    if not keys:
        raise InputError(f"the API keys file {path} holds no keys")
    return keys


def tenant_for(keys: dict[str, str] | None, authorization: str | None) -> str | None:
    """The tenant of a ``Bearer`` key (compared in constant time), DEFAULT_TENANT when the
    server has no keys, None when the key is missing or unknown."""
    if keys is None:
        return DEFAULT_TENANT
    scheme, _, credentials = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not credentials.strip():  # the scheme is case-insensitive (RFC 9110)
        return None
    given = credentials.strip().encode()
    tenant = None
    for key, name in keys.items():
        if hmac.compare_digest(key.encode(), given):
            tenant = name
    return tenant


class TenantStreams:
    """One proposer per tenant, made (and its memory loaded) at the tenant's first request."""

    def __init__(self, method: str, vocab_size: int, memory_dir: str | Path | None = None,
                 memory_rows: int | None = None):
        self.method = method
        self.memory_rows = memory_rows
        self.vocab_size = vocab_size
        self.memory_dir = Path(memory_dir) if memory_dir is not None else None
        if self.memory_dir is not None:
            self.memory_dir.mkdir(parents=True, exist_ok=True)
            stale = remove_stale_temporaries(self.memory_dir)
            if stale:
                log.warning("removed %d temporary file(s) of saves interrupted by a crash", len(stale))
        self.streams: dict[str, Proposer] = {}
        self._locks: dict[str, threading.RLock] = {}
        self._locks_guard = threading.Lock()

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
                try:
                    saved = read_token_memory(path)
                    if saved.vocab_size != self.vocab_size:
                        raise MemoryFileError(f"made for a vocabulary of {saved.vocab_size} tokens, not "
                                              f"{self.vocab_size}")
                    proposer.load_memory(path)
                except MemoryFileError as error:
                    aside = path.with_name(f"{path.name}.unreadable-{time.strftime('%Y%m%dT%H%M%S')}"
                                           f"-{secrets.token_hex(3)}")  # two in one second keep both
                    path.replace(aside)
                    log.warning("tenant %s: memory file unusable (%s); moved to %s, starting cold",
                                tenant, error, aside.name)
            self.streams[tenant] = proposer
        return self.streams[tenant]

    def save(self, tenant: str, timeout: float | None = None) -> bool:
        """Write the tenant's memory (if it has a file and anything to save) under its lock;
        waits ``timeout`` seconds at most for a request in flight (None: as long as it takes).
        False when it gave up: the file then keeps its last save."""
        path, proposer = self.path(tenant), self.streams.get(tenant)
        if path is None or proposer is None or not hasattr(proposer, "save_memory"):
            return True
        lock = self.lock(tenant)
        if not lock.acquire(timeout=-1 if timeout is None else timeout):
            log.warning("tenant %s: a request still uses its stream; its memory file keeps the last save", tenant)
            return False
        try:
            proposer.save_memory(path)
        except InputError:
            pass  # nothing learned yet
        except OSError as error:
            log.error("tenant %s: could not save its memory to %s: %s", tenant, path, error)
        finally:
            lock.release()
        return True

    def save_request(self, tenant: str) -> bool:
        """`save` after one of the tenant's requests left the decoder (with its lock held);
        `recap.serve.shared.SharedTenantStreams` also counts the request and versions the file."""
        return self.save(tenant)

    def save_all(self, timeout: float | None = None) -> None:
        """`save` every tenant (``timeout`` for each)."""
        for tenant in list(self.streams):
            self.save(tenant, timeout)
