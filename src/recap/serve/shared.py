"""Tenant memories shared by several server processes (``recap serve --replicas``): the memory
folder is the source of truth, whichever replica a tenant's request lands on.

Each tenant's file carries, in its safetensors metadata, a save version (``recap_revision``),
the count of the tenant's requests it includes (``recap_requests``) and the ids of the last
`LEARNED_IDS` of them (``recap_learned``). A replica decodes a
tenant's request only while it holds the tenant's lock: an exclusive BSD lock
(``fcntl.flock``) on ``<tenant>.lock`` beside the memory file (a file of its own: a save
replaces the memory file by a rename, which would drop a lock held on it). Taking the lock
when the replica holds it for none of the tenant's requests yet, it reloads the tenant's
stream if the file's version differs from its copy's (another replica saved since); after
each request it saves atomically (temporary file, fsync, rename) with version + 1, and lets
the lock go only when the tenant's last request in this process has ended and been saved.
So no save is ever based on a stale copy: no request's learning is lost, and a file's
request count is exactly the requests it learned from. As in the single server, the decoder
only copies the stream (with version and count) and the saver thread writes it
(`recap.serve.saver`); `release` waits for that write before it lets the lock go, so the
order above holds, and a write that failed makes the next hold reload the file. A header
that cannot be read for a reason that may pass (EIO, EMFILE) refuses the request
(`MemoryUnavailable`, a 503) and touches neither the file nor the copy's version; only a
damaged one counts as version 0 (its load then moves the file aside).

A request keeps its id when the front runs it again on another replica
(`recap.serve.scale`). A replica that dies after its save but before its answer reached the
front has learned from the request already: the file lists the id, so the retry is answered
from a throwaway copy of the stream and neither counted nor saved (`locked_events`): a
request is learned from once.

The lock is handed over rather than raced for: a waiting replica holds a shared lock on
``<tenant>.want``; a replica holding the tenant sees it and queues no further request of the
tenant under its current hold, and after letting the lock go it waits up to `YIELD_S` for the
waiter to take it. A tenant's requests on two replicas therefore alternate (each switch is a
reload) instead of one replica starving the other.

Affinity (`recap.serve.router`) only makes the reloads rare; correctness never depends on it.
The lock is per process (two requests of one tenant in one replica share it, as they share
the stream), and a replica that dies releases it (the kernel drops a dead process's locks).
Across machines the folder must be on a filesystem whose ``flock`` locks are seen by every
machine (see docs/serve.md, "Scaling out").
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recap.core.persistence import TEMPORARY, file_metadata, parse_count, private_folder
from recap.errors import InputError
from recap.serve.engine import Engine, Job, QueueFull
from recap.serve.tenants import MemoryUnavailable, TenantStreams

log = logging.getLogger("recap.serve")
VERSION_KEY = "recap_revision"
REQUESTS_KEY = "recap_requests"
LEARNED_KEY = "recap_learned"
LEARNED_IDS = 64
"""Ids of the last requests a file learned from that it lists (comma-separated, oldest first)."""
REQUEST_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")
"""What a listed request id may be (`recap.serve.scale` sends 32 hex digits)."""
STALE_TEMPORARY_S = 3600.0
"""A save's temporary file older than this is a dead writer's (a save takes seconds). Process
ids cannot tell, as the single server's cleanup does: the writer may be on another machine."""
LOCK_POLL_S = (0.002, 0.02)
"""First and longest wait between two tries of a tenant's lock (it doubles in between)."""
STALE = -2
"""The version of a copy whose last save failed: no file has it (`file_version` is -1 at
least), so the next hold reloads the file."""
YIELD_S = 1.0
"""After letting a tenant's lock go while another process waits for it, a replica waits this
long at most for that process to take it before competing for it again."""


class TenantBusy(Exception):
    """The tenant's lock could not be taken before the request was cancelled or ran out of time."""


def memory_metadata(path: str | os.PathLike) -> dict[str, str] | None:
    """The string metadata of a memory file (its header only: no tensor is read), None when
    there is no file; a damaged file gives ``{}`` (its load then moves it aside). A read that
    failed for a reason that may pass (EIO, EMFILE: an `OSError`) raises `MemoryUnavailable`:
    the file may be fine, and taking it for version 0 could save an older copy over it."""
    try:
        return file_metadata(path)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise MemoryUnavailable(f"memory file {Path(path).name} could not be read just now "
                                f"({error.strerror or error}); retry") from None
    except ValueError:  # a damaged header (`json` errors are ValueErrors too)
        return {}


def file_version(metadata: dict[str, str] | None) -> int:
    """A file's save version: 0 without a file or without the field, -1 when the field is not a number."""
    if metadata is None:
        return 0
    try:
        return parse_count(metadata.get(VERSION_KEY, "0"))
    except ValueError:  # "²" passes isdigit() and fails int(): not a version this module wrote
        return -1


def learned_ids(metadata: dict[str, str] | None) -> list[str]:
    """The ids of the last requests a file learned from (``recap_learned``), oldest first;
    ``[]`` without the field and for a value this module did not write (damaged or hostile:
    never trusted further, never an error)."""
    value = (metadata or {}).get(LEARNED_KEY, "")
    if not isinstance(value, str) or not value or len(value) > LEARNED_IDS * 65:
        return []
    ids = value.split(",")
    if len(ids) > LEARNED_IDS or not all(REQUEST_ID.fullmatch(one) for one in ids):
        return []
    return ids


def remove_old_temporaries(folder: str | os.PathLike, age_s: float = STALE_TEMPORARY_S) -> list[str]:
    """Delete save temporaries (``*.tmp-*``) last changed more than ``age_s`` seconds ago."""
    removed, now = [], time.time()
    for entry in os.scandir(folder):
        if TEMPORARY.fullmatch(entry.name) is None or not entry.is_file(follow_symlinks=False):
            continue
        try:
            if now - entry.stat(follow_symlinks=False).st_mtime > age_s:
                os.unlink(entry.path)
                removed.append(entry.name)
        except FileNotFoundError:
            pass
    return removed


@dataclass
class _Hold:
    """This process's hold on one tenant's lock: how many of its requests use it, the open
    lock file, whether one of its requests is taking the lock now, and until when it lets
    another process's waiting request go first after letting the lock go."""

    changed: threading.Condition
    count: int = 0
    fd: int | None = None
    acquiring: bool = False
    yield_until: float = 0.0


class SharedTenantStreams(TenantStreams):
    """`TenantStreams` whose memory folder other processes use at the same time. Every request
    is bracketed by `hold` (before it is queued for the decoder) and `release` (after its
    final event); `save_request` (the decoder, at the request's end) counts it and saves with
    the next version. ``use_lock=False`` keeps everything but the file lock: a negative
    control for the tests, which must then see lost updates."""

    def __init__(self, method: str, vocab_size: int, memory_dir: str | Path | None = None,
                 memory_rows: int | None = None, *, use_lock: bool = True):
        super().__init__(method, vocab_size, None, memory_rows)
        self.memory_dir = Path(memory_dir) if memory_dir is not None else None
        if self.memory_dir is not None:
            private_folder(self.memory_dir)
            stale = remove_old_temporaries(self.memory_dir)
            if stale:
                log.warning("removed %d temporary file(s) of saves interrupted long ago", len(stale))
        self.use_lock = use_lock
        self.versions: dict[str, int] = {}
        """The file version each tenant's stream was loaded from or last saved as."""
        self.requests: dict[str, int] = {}
        """Each tenant's requests counted in its stream (persisted with it)."""
        self.learned: dict[str, list[str]] = {}
        """The ids of each tenant's last requests counted in its stream (persisted with it)."""
        self.reloads = 0
        self._holds: dict[str, _Hold] = {}
        self._holds_guard = threading.Lock()

    def lock_path(self, tenant: str) -> Path:
        path = self.path(tenant)
        assert path is not None
        return path.with_name(f"{tenant}.lock")

    def want_path(self, tenant: str) -> Path:
        return self.lock_path(tenant).with_name(f"{tenant}.want")

    def _hold(self, tenant: str) -> _Hold:
        with self._holds_guard:
            hold = self._holds.get(tenant)
            if hold is None:
                hold = self._holds[tenant] = _Hold(threading.Condition())
            return hold

    def holding(self, tenant: str) -> bool:
        """Whether some request of this process holds the tenant's lock."""
        return self._hold(tenant).count > 0

    def others_wait(self, tenant: str) -> bool:
        """Whether a request of another process waits for the tenant's lock (it holds a shared
        lock on ``<tenant>.want`` while it waits)."""
        fd = os.open(self.want_path(tenant), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops the probe's lock
        return False

    def hold(self, tenant: str, cancelled: threading.Event | None = None, deadline: float = float("inf")) -> None:
        """Take the tenant's lock for one request, reloading the stream if the file changed
        since this process's copy. A request joins the hold of this process's requests of the
        tenant already running (they share the stream) unless another process waits for the
        lock: then it waits for them to end and takes the lock in turn, so a tenant's
        requests on two replicas alternate instead of one replica starving the other.
        Raises `TenantBusy` if ``cancelled`` is set or ``deadline`` (monotonic) passes first.
        Call from a request's own thread, never the decoder's: it may wait."""
        if self.memory_dir is None:
            return
        hold = self._hold(tenant)
        with hold.changed:
            while True:
                if hold.count > 0 and not (self.use_lock and self.others_wait(tenant)):
                    hold.count += 1
                    return
                if hold.count == 0 and not hold.acquiring:
                    hold.acquiring = True
                    break
                self._check(tenant, cancelled, deadline)
                hold.changed.wait(LOCK_POLL_S[1])
        fd = None
        try:
            if self.use_lock:
                fd = self._lock_file(tenant, hold, cancelled, deadline)
            self._sync_with_file(tenant)
        except BaseException:
            self._unlock(fd)
            with hold.changed:
                hold.acquiring = False
                hold.changed.notify_all()
            raise
        with hold.changed:
            hold.fd, hold.acquiring = fd, False
            hold.count += 1
            hold.changed.notify_all()

    def release(self, tenant: str) -> None:
        """One request of the tenant is over (its final event about to be sent, its save handed
        to the saver). The last one of this process waits for the saver to have written the
        tenant's saves before the lock goes: another process then reads the newest file."""
        if self.memory_dir is None:
            return
        hold = self._hold(tenant)
        with hold.changed:
            if hold.count <= 0:
                raise RuntimeError(f"tenant {tenant}: released more often than held")
            hold.count -= 1
            if hold.count == 0:
                self.saver.wait(tenant)
                if self.saver.last_failed(tenant):  # the file is older than this copy: reload it next time
                    self.versions[tenant] = STALE
                fd, hold.fd = hold.fd, None
                if fd is not None and self.others_wait(tenant):
                    hold.yield_until = time.monotonic() + YIELD_S
                self._unlock(fd)
            hold.changed.notify_all()

    @staticmethod
    def _check(tenant: str, cancelled: threading.Event | None, deadline: float) -> None:
        if (cancelled is not None and cancelled.is_set()) or time.monotonic() > deadline:
            raise TenantBusy(f"tenant {tenant}: another replica kept its memory locked")

    def _lock_file(self, tenant: str, hold: _Hold, cancelled: threading.Event | None, deadline: float) -> int:
        """The tenant's lock file, locked. Having just let the lock go to a waiting process,
        first give it up to `YIELD_S` to take it; then try, and while the lock is taken, wait
        as a registered waiter (a shared lock on ``<tenant>.want``)."""
        wait = LOCK_POLL_S[0]
        while time.monotonic() < hold.yield_until and self.others_wait(tenant):
            self._check(tenant, cancelled, deadline)
            time.sleep(wait)
            wait = min(2 * wait, LOCK_POLL_S[1])
        fd = os.open(self.lock_path(tenant), os.O_RDWR | os.O_CREAT, 0o600)
        want = None
        wait = LOCK_POLL_S[0]
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return fd
                except BlockingIOError:
                    pass
                if want is None:
                    want = os.open(self.want_path(tenant), os.O_RDWR | os.O_CREAT, 0o600)
                    fcntl.flock(want, fcntl.LOCK_SH)  # a probe holds it exclusively for microseconds only
                self._check(tenant, cancelled, deadline)
                time.sleep(wait)
                wait = min(2 * wait, LOCK_POLL_S[1])
        except BaseException:
            os.close(fd)
            raise
        finally:
            if want is not None:
                os.close(want)

    @staticmethod
    def _unlock(fd: int | None) -> None:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def learned_from(self, tenant: str, request_id: str | None) -> bool:
        """Whether the tenant's stream has learned from the request already (its file lists
        the id). Only meaningful while this process holds the tenant (`hold`)."""
        return request_id is not None and request_id in self.learned.get(tenant, ())

    def _sync_with_file(self, tenant: str) -> None:
        """Under the lock: make the tenant's stream the file's, unless it already is. A header
        that cannot be read just now raises `MemoryUnavailable`, with nothing changed."""
        path = self.path(tenant)
        metadata = memory_metadata(path)
        version = file_version(metadata)
        if tenant in self.streams and version == self.versions.get(tenant, 0):
            return
        if tenant in self.streams:
            self.reloads += 1
            log.info("tenant %s: memory file at version %d (this replica had %d); reloading", tenant, version,
                     self.versions.get(tenant, 0))
        self.streams.pop(tenant, None)
        self.stream(tenant)  # loads the file (a file it cannot use is moved aside: then version 0)
        if not path.exists():
            metadata, version = None, 0
        requests = (metadata or {}).get(REQUESTS_KEY, "0")
        self.versions[tenant] = max(version, 0)
        self.learned[tenant] = learned_ids(metadata)
        try:
            self.requests[tenant] = parse_count(requests)
        except ValueError:
            self.requests[tenant] = 0

    def save_request(self, tenant: str, request_id: str | None = None) -> bool:
        """Count the request (its id among the last `LEARNED_IDS` learned from) and save the
        stream as the next version, with the lock held."""
        path = self.path(tenant)
        if path is None:
            return True
        with self.lock(tenant):
            if self.use_lock and not self.holding(tenant):
                log.error("tenant %s: a request ended without the tenant's lock; its memory is not saved", tenant)
                return False
            self.requests[tenant] = self.requests.get(tenant, 0) + 1
            if request_id is not None and REQUEST_ID.fullmatch(request_id):
                ids = [one for one in self.learned.get(tenant, []) if one != request_id] + [request_id]
                self.learned[tenant] = ids[-LEARNED_IDS:]
            proposer = self.streams.get(tenant)
            if proposer is None or not hasattr(proposer, "memory_snapshot"):
                return True
            version = max(self.versions.get(tenant, 0), 0) + 1
            try:
                snapshot = proposer.memory_snapshot()
            except InputError:
                return True  # nothing learned yet
            self.saver.submit(tenant, path, snapshot, metadata={
                VERSION_KEY: str(version), REQUESTS_KEY: str(self.requests[tenant]),
                LEARNED_KEY: ",".join(self.learned.get(tenant, []))})
            self.versions[tenant] = version
        return True

    def save(self, tenant: str, timeout: float | None = None) -> bool:
        """Every request's end saved already; a save outside a request (shutdown) could
        overwrite another replica's newer file, so there is none."""
        return True


FINAL = ("done", "error")


def locked_events(engine: Engine, tenants: SharedTenantStreams, job: Job) -> Iterator[dict[str, Any]]:
    """Run ``job`` on ``engine`` with its tenant's lock held, yielding its events (a replica's
    request, `recap.serve.scale.Replica.decode`). The lock is taken before the job is queued
    and let go after the decoder handed the tenant's save over (`Engine._end`) and the saver
    wrote it (`SharedTenantStreams.release`), just before the final event; a caller that
    stops early still waits for the decoder to be done with the job. A job whose
    ``request_id`` the tenant's file lists already (a retry of a request whose replica died
    after its save) is answered without learning (``job.learn`` False: a throwaway copy of
    the stream, not counted, not saved). ``job.emit`` is replaced."""
    events: queue.Queue[dict[str, Any]] = queue.Queue()
    job.emit = events.put
    held = queued = False
    try:
        try:
            tenants.hold(job.tenant, job.cancelled, job.deadline)
            held = True
            if tenants.learned_from(job.tenant, job.request_id):
                log.info("tenant %s: its memory holds request %s already; answering it without learning",
                         job.tenant, job.request_id)
                job.learn = False
            engine.submit(job)
            queued = True
        except TenantBusy as error:
            yield {"type": "error", "message": str(error), "status": 499 if job.cancelled.is_set() else 504}
            return
        except MemoryUnavailable as error:
            log.warning("tenant %s: %s", job.tenant, error)
            yield {"type": "error", "message": "this tenant's memory could not be read just now; retry",
                   "status": 503}
            return
        except QueueFull as error:
            yield {"type": "error", "message": f"the server is busy: {error}; retry later", "status": 429}
            return
        while True:
            event = events.get()
            if event["type"] in FINAL:
                held = queued = False
                tenants.release(job.tenant)
                yield event
                return
            yield event
    finally:
        if queued:  # the caller left early: the decoder must be done with the job before the lock goes
            job.cancel()
            while events.get()["type"] not in FINAL:
                pass
        if held:
            tenants.release(job.tenant)
