"""Tenants' memory files written off the decoder thread (issue 46).

A save hashes and writes a tenant's whole memory (megabytes) and fsyncs twice: done on the
decoder thread at every request's end, it held every tenant's next step back. The decoder
now only copies the memory (`Proposer.memory_snapshot`, under the tenant's lock, so never a
stream mid-change) and hands the copy to `MemorySaver`, whose one thread writes it.

- Coalesced: at most one snapshot per tenant waits; a newer one replaces it (only the newest
  state is worth writing), so a tenant with many short requests costs one write at a time
  and memory for two snapshots at most (one waiting, one being written).
- In order: one thread writes, a tenant's snapshots in the order they were taken, so an
  older snapshot never lands over a newer file.
- A failed write (disk full, I/O error, a bug) is logged in one line; the thread goes on and
  the tenant's next snapshot is written as usual.
- `flush` waits until every snapshot handed over is on disk: the server's shutdown flushes
  before it lets the memory folder go, so a clean shutdown loses nothing. A crash loses what
  was still waiting: at most the saver's lag, never a torn file (writes are atomic).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("recap.serve")


class Snapshot(Protocol):
    """What a proposer's ``memory_snapshot`` returns (`recap.core.persistence.MemorySnapshot`):
    a copy of its memory that writes itself."""

    def write(self, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None: ...


@dataclass
class _Save:
    path: str | os.PathLike
    snapshot: Snapshot
    metadata: dict[str, str] | None


class MemorySaver:
    """One background thread writing tenants' memory snapshots, coalesced per tenant and in
    order (see the module's doc). ``on_coalesced``: called (on the submitting thread) each
    time a waiting snapshot is replaced by a newer one, e.g. a metric's ``inc``."""

    def __init__(self, on_coalesced: Callable[[], None] | None = None):
        self.on_coalesced = on_coalesced
        self.written = 0
        """Snapshots written."""
        self.coalesced = 0
        """Snapshots replaced by a newer one of the same tenant before being written."""
        self.failed = 0
        """Writes that raised (logged)."""
        self._pending: dict[str, _Save] = {}
        """Tenant -> its newest snapshot not yet being written; oldest tenant first."""
        self._writing: str | None = None
        self._failed_last: set[str] = set()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def pending(self) -> int:
        """Snapshots waiting or being written."""
        with self._changed:
            return len(self._pending) + (self._writing is not None)

    def submit(self, tenant: str, path: str | os.PathLike, snapshot: Snapshot,
               metadata: dict[str, str] | None = None) -> None:
        """Have ``snapshot`` written to ``path`` (with extra string ``metadata``) soon; it
        replaces the tenant's snapshot still waiting, if any. Returns at once."""
        with self._changed:
            replaced = tenant in self._pending
            self._pending[tenant] = _Save(path, snapshot, metadata)  # a replaced one keeps its place in line
            self._stopping = False
            if replaced:
                self.coalesced += 1
            if self._thread is None:  # started at the first save (a server without one has no thread)
                self._thread = threading.Thread(target=self._run, name="recap-saver", daemon=True)
                self._thread.start()
            self._changed.notify_all()
        if replaced and self.on_coalesced is not None:
            self.on_coalesced()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every snapshot submitted so far is written (or failed); False if
        ``timeout`` seconds passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._pending and self._writing is None, timeout)

    def wait(self, tenant: str, timeout: float | None = None) -> bool:
        """Wait until the tenant's snapshots submitted so far are written (or failed)."""
        with self._changed:
            return self._changed.wait_for(lambda: tenant not in self._pending and self._writing != tenant, timeout)

    def last_failed(self, tenant: str) -> bool:
        """Whether the tenant's latest write failed (its file is older than its last snapshot)."""
        with self._changed:
            return tenant in self._failed_last

    def close(self, timeout: float | None = None) -> bool:
        """`flush`, then end the thread (a later `submit` starts another)."""
        flushed = self.flush(timeout)
        with self._changed:
            self._stopping = True
            thread = self._thread
            self._changed.notify_all()
        if thread is not None and flushed:
            thread.join(timeout)
        return flushed

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._pending and not self._stopping:
                    self._changed.wait()
                if not self._pending:
                    self._thread = None
                    return
                tenant = next(iter(self._pending))
                save = self._pending.pop(tenant)
                self._writing = tenant
            ok = False
            try:
                save.snapshot.write(save.path, save.metadata)
                ok = True
            except Exception as error:  # noqa: BLE001 - one tenant's failed write must not stop the others'
                log.error("tenant %s: could not save its memory to %s: %s", tenant, os.path.basename(save.path),
                          getattr(error, "strerror", None) or error)
            with self._changed:
                self._writing = None
                if ok:
                    self.written += 1
                    self._failed_last.discard(tenant)
                else:
                    self.failed += 1
                    self._failed_last.add(tenant)
                self._changed.notify_all()
