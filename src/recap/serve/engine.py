"""One model, continuous batching: a queue in front of a single decoding thread that steps a
`recap.batching.Batch`; a free lane goes to the oldest job of the tenant with the fewest
requests decoding (`Engine._next_job`), so no tenant's flood takes every lane from the others.

The HTTP side submits a `Job` (already validated: its inputs prepared) and reads its events;
the worker moves queued jobs into the batch (each on a lane of its own, prefilled one per
step so running requests never wait longer than one prefill), steps every running request
in one forward, turns each request's step into text (`IncrementalDetokenizer`), and checks
between steps whether a job was cancelled (client gone, time limit, shutdown). Whatever
happens, the request's lane is freed and a copy of its tenant's memory handed to the saver
thread (`recap.serve.saver`) before it is answered: the worker copies, never writes, so no
tenant's step waits for another's disk. The worker holds the tenant's lock while any of its
requests runs, so a save (the shutdown's included) never reads a stream mid-change. A
tenant's requests that overlap run on forks of its stream (`Proposer.fork_request`).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from recap.batching import DEFAULT_MAX_BATCH, Batch, BatchEvent
from recap.decoding import Decoding
from recap.serve.tenants import MemoryUnavailable, TenantStreams
from recap.verifier import ModelInputs, Target
from recap.verifier.sampling import Sampling

log = logging.getLogger("recap.serve")


class QueueFull(Exception):
    """The queue holds ``max_queue`` waiting requests already."""


class Unavailable(QueueFull):
    """The engine cannot take any job now (a 503, not a 429: retrying here soon is futile)."""

    code = "unavailable"


class ShuttingDown(Unavailable):
    """The engine refuses new jobs: it is shutting down."""

    code = "shutting_down"


OVERDUE = 0.5
"""A queued job that has waited this share of its time limit is taken before the fair pick
(`Engine._next_job`)."""
SHUTTING_DOWN = {"type": "error", "message": "the server is shutting down", "status": 503, "code": "shutting_down"}
"""The final event of a request the server ends because it is going down (copied per use)."""


class NoReplica(Unavailable):
    """Every replica of a scaled engine has died."""

    code = "no_replica"


class IncrementalDetokenizer:
    """Text deltas from token ids, computed as vLLM's and TGI's servers do: each step decodes
    only a window of recent tokens, ``tokens[prefix:]``, and sends what it adds past the text
    of ``tokens[prefix:read]`` (the context, already sent), once that text is stable: longer
    than the context's, and not ending in U+FFFD (a character whose bytes are still coming).
    The window is the last sent step plus what is held back, so a step's work does not grow
    with the answer. `finish` flushes the rest and gives the answer, which is by construction
    the concatenation of every delta: ``tokenizer.decode(all tokens)`` whenever that starts
    with the text sent (any tokenizer that does not rewrite text once more tokens follow it),
    else what was sent plus the window's rest (vLLM's answer too: a stream cannot take text
    back)."""

    MAX_HELD = 64
    """Tokens held back (no stable text yet) beyond which their text is sent as it is, so a
    model that keeps producing partial characters or empty tokens cannot grow the window."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self._drafted: list[bool] = []
        self._prefix = 0
        self._read = 0
        self._prefix_text = ""
        self._sent: list[str] = []

    def _decode(self, start: int, stop: int) -> str:
        return self.tokenizer.decode(self.tokens[start:stop], skip_special_tokens=True)

    def add(self, tokens: Sequence[int], drafted: int = 0) -> tuple[str, str]:
        """Take one step's tokens (the first ``drafted`` of them accepted drafts); return the
        text to send now and its leading part that came from accepted drafts (both may be
        empty)."""
        self.tokens.extend(int(t) for t in tokens)
        self._drafted.extend(i < drafted for i in range(len(tokens)))
        text = self._decode(self._prefix, len(self.tokens))
        held = len(self.tokens) - self._read
        if held < self.MAX_HELD and (len(text) <= len(self._prefix_text) or text.endswith("\ufffd")):
            return "", ""
        delta = text[len(self._prefix_text):]
        drafted_text = delta[: self._drafted_chars(len(delta))]
        self._prefix, self._read = self._read, len(self.tokens)
        self._prefix_text = self._decode(self._prefix, self._read)
        self._sent.append(delta)
        return delta, drafted_text

    def finish(self) -> tuple[str, str, str]:
        """(the rest to send, its drafted leading part, the whole answer). The only decode of
        the whole answer: once, to check that the text sent is its prefix."""
        sent = "".join(self._sent)
        whole = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if whole.startswith(sent):
            rest = whole[len(sent):]
        else:  # the tokenizer rewrote text already sent: the answer is what the stream showed
            rest = self._decode(self._prefix, len(self.tokens))[len(self._prefix_text):]
        drafted_text = rest[: self._drafted_chars(len(rest))]
        self._sent.append(rest)
        return rest, drafted_text, sent + rest

    def _drafted_chars(self, length: int) -> int:
        """How many leading characters of the delta that starts at the read offset came from
        accepted drafts: those of the run of drafted tokens it starts with (a character the
        run leaves incomplete not counted)."""
        end = self._read
        while end < len(self.tokens) and self._drafted[end]:
            end += 1
        if end == self._read:
            return 0
        if end == len(self.tokens):
            return length
        run = self._decode(self._prefix, end).rstrip("\ufffd")
        return max(0, min(length, len(run) - len(self._prefix_text)))


class StopStrings:
    """Ends an answer where a stop string first appears, across step deltas: text that could
    still be the start of one is held back until the next delta shows it is not."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.text = ""
        """What was let through: the answer, truncated before the stop string once one appears."""
        self._held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text to send now, whether a stop string appeared: then nothing more is sent). A
        stop string found in the text ends it only when no other stop string could still
        begin before it (its start is all the text there is so far): "baa" starting at 0 beats
        "a" found at 1."""
        buffer = self._held + delta
        found = [i for i in (buffer.find(stop) for stop in self.stops) if i >= 0]
        first = min(found, default=len(buffer))
        longest = max(len(stop) for stop in self.stops)
        pending = next((j for j in range(max(0, len(buffer) - longest + 1), first)
                        if any(len(stop) > len(buffer) - j and stop.startswith(buffer[j:]) for stop in self.stops)),
                       None)
        if found and pending is None:
            out, self._held = buffer[:first], ""
            self.text += out
            return out, True
        cut = len(buffer) if pending is None else pending
        out, self._held = buffer[:cut], buffer[cut:]
        self.text += out
        return out, False

    def flush(self) -> tuple[str, bool]:
        """The held-back tail once the answer has ended, cut before the first stop string in
        it (one may be there, held while a longer one could still have begun earlier), and
        whether there was one."""
        buffer, self._held = self._held, ""
        found = [i for i in (buffer.find(stop) for stop in self.stops) if i >= 0]
        out = buffer[:min(found)] if found else buffer
        self.text += out
        return out, bool(found)


@dataclass
class Job:
    tenant: str
    inputs: ModelInputs
    max_tokens: int
    emit: Callable[[dict[str, Any]], None]
    """Receives events: ``{"type": "text", "text", "drafted_text", "tokens", "drafted"}`` per
    step, then one ``{"type": "done", ...}`` or ``{"type": "error", "message"}``. Called
    from the worker thread."""
    sampling: Sampling | None = None
    streamed: bool = False
    """The client sees text as it comes (a stream cannot take it back); otherwise only the
    final answer, so a failed decode may be run again from the start."""
    stop: tuple[str, ...] = ()
    """Stop strings: the answer ends where one first appears (`StopStrings`)."""
    deadline: float = float("inf")
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    request_id: str | None = None
    """An id the request keeps when it is run again (`recap.serve.scale`), handed to the
    tenant's save with it (`recap.serve.shared` lists it in the memory file)."""
    learn: bool = True
    """False: the tenant's memory already holds this request (`recap.serve.shared`): it is
    answered from a throwaway copy of the tenant's stream, not counted and not saved."""

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class _Active:
    """A job in the batch: its decoding, its text so far, and whether it has its tenant's stream."""

    job: Job
    decoding: Decoding
    detokenizer: IncrementalDetokenizer
    stops: StopStrings | None = None


STEP_SLOWDOWN = 2.0
"""The default batch is as large as this machine's step allows while a step of one row per
request costs at most this many one-token steps: each request's step time at most doubles."""


def default_max_batch(target: Target) -> int:
    """Requests stepped together by default, read off this machine's verify-cost profile:
    the most requests B (2 to 64) whose one-row-each step costs at most `STEP_SLOWDOWN` x a
    one-token step, t(B) <= 2 t(1). 1 where lanes do not share a forward (the stock
    kernels); `recap.batching.DEFAULT_MAX_BATCH` where there is no profile."""
    if not target.batches:
        return 1
    profile = target.verify_cost()
    if profile is None:
        return DEFAULT_MAX_BATCH
    times = profile.predict(np.arange(1, 65), float(np.min(profile.contexts)))  # t(1)..t(64), shortest context
    fits = np.flatnonzero(times <= STEP_SLOWDOWN * times[0])
    return int(min(64, max(2, fits[-1] + 1)))


class Engine:
    """The decoding thread, its queue and its continuous batch."""

    def __init__(self, target: Target, tenants: TenantStreams, *, max_queue: int = 64,
                 max_batch: int | None = None, shared_budget: bool = True,
                 on_finish: Callable[[Job, dict[str, Any]], None] | None = None):
        self.target = target
        self.tenants = tenants
        self.max_queue = max_queue
        self.on_finish = on_finish
        self.batch = Batch(max_batch=max_batch or default_max_batch(target), shared_budget=shared_budget)
        self._jobs: deque[Job] = deque()
        """Submitted jobs not yet in the batch, oldest first (`_next_job` picks among them)."""
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self._accepting = True
        self._active: dict[Decoding, _Active] = {}
        self._in_flight: dict[str, int] = {}
        """Requests of each tenant in the batch: the first has the tenant's stream, the others
        a fork of it (`Proposer.fork_request`)."""
        self._thread = threading.Thread(target=self._run, name="recap-decoder", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting: queued, or taken but not yet prefilled (running ones not counted)."""
        return len(self._jobs) + len(self.batch.waiting)

    @property
    def busy(self) -> bool:
        """Whether a request is being decoded (or taken into the batch)."""
        return bool(self._active) or self._admitting

    def submit(self, job: Job) -> None:
        with self._lock:
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            if self.depth >= self.max_queue:
                raise QueueFull(f"{self.depth} requests are already waiting")
            self._jobs.append(job)
            self._wake.notify()

    def drain(self, grace: float) -> None:
        """Begin shutting down without waiting (`recap.serve.http.DrainingServer` calls it on
        SIGTERM): new jobs are refused (503 ``shutting_down``), the waiting ones answered so
        now, and the running ones get ``grace`` seconds to finish, after which each ends with
        a 503 ``shutting_down`` event. `shutdown` (after the HTTP server closed) then saves."""
        with self._lock:
            self._accepting = False
            waiting, self._jobs = list(self._jobs), deque()
            self._drain_deadline = time.monotonic() + grace
            self._wake.notify()
        for job in waiting:
            job.cancel()
            self._finish(job, dict(SHUTTING_DOWN))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, cancel the waiting ones, let the running ones finish (or cancel
        them after ``timeout``), then save every tenant's memory and wait for the saver to
        have written every save before the memory folder is let go."""
        with self._lock:
            self._accepting = False
            waiting, self._jobs = list(self._jobs), deque()
            self._stopping = True
            self._wake.notify()
        for job in waiting:
            job.cancel()
            self._finish(job, dict(SHUTTING_DOWN))
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the requests in flight did not finish within %.0f s; cancelling them", timeout)
            self._cancel_current = True
            self._thread.join(timeout)
        # a decoder still running holds its tenants' locks: those tenants keep their last saved file
        self.tenants.save_all(timeout=0.0 if self._thread.is_alive() else None)
        self.tenants.flush()  # every save handed over is on disk
        if not self._thread.is_alive():  # a decoder still running may save again: keep the folder
            self.tenants.close()

    # ------------------------------------------------------------------ worker
    _cancel_current = False
    _admitting = False
    _drain_deadline = float("inf")
    """When `drain` began, plus its grace: running requests past it end with a 503."""

    def _run(self) -> None:
        stopping = False
        while not stopping or self._active:
            stopping = self._take(block=not self._active) or stopping
            if not self._active:
                continue
            try:
                events = self.batch.step()
            except Exception:  # noqa: BLE001 - the worker must survive any request
                log.exception("a batched step failed")
                for active in list(self._active.values()):
                    self.batch.cancel(active.decoding)
                    self._end(active, {"type": "error", "message": "internal server error", "status": 500})
                continue
            for event in events:
                self._on_event(event)
            self._check_limits()

    def _take(self, block: bool) -> bool:
        """Move queued jobs into the batch while it has room (waiting for one when ``block``),
        so a job's stream (or fork of it) is taken when it is about to run; True on
        shutdown, once nothing is left to take."""
        while block or len(self.batch) < self.batch.max_batch:
            with self._lock:
                while block and not self._jobs and not self._stopping:
                    self._wake.wait()
                if not self._jobs:
                    return self._stopping
                job = self._next_job()
            block = False
            if job.cancelled.is_set():
                self._finish(job, {"type": "error", "message": "cancelled before it started", "status": 499})
                continue
            if time.monotonic() > job.deadline:  # it waited past its time limit: no lane for it
                self._finish(job, {"type": "error", "message": "the request ran past the server's time limit",
                                   "status": 504})
                continue
            try:
                self._admit(job)
            except MemoryUnavailable as error:
                log.warning("%s", error)
                self._finish(job, {"type": "error", "status": 503,
                                   "message": "this tenant's memory could not be read just now; retry"})
            except Exception:  # noqa: BLE001
                log.exception("request failed")
                self._finish(job, {"type": "error", "message": "internal server error", "status": 500})
        return False

    def _next_job(self) -> Job:
        """The next job to run (called with the lock held): the oldest of the tenant with the
        fewest requests in the batch, so a tenant that floods the queue takes every free lane
        only while no one else is waiting; but a job that has waited `OVERDUE` of its time
        limit goes first (the oldest such), so no tenant's request, a flooder's included,
        starves in the queue until it expires."""
        now = time.monotonic()

        def overdue(job: Job) -> bool:
            return now - job.submitted >= OVERDUE * (job.deadline - job.submitted)

        late = [i for i, job in enumerate(self._jobs) if overdue(job)]
        best = late[0] if late else \
            min(range(len(self._jobs)), key=lambda i: (self._in_flight.get(self._jobs[i].tenant, 0), i))
        job = self._jobs[best]
        del self._jobs[best]
        return job

    def _admit(self, job: Job) -> None:
        """Queue the job's decoding in the batch, on a lane of its own, with its tenant's stream
        (or a fork of it when another of the tenant's requests is in flight). The tenant's lock
        is held until the request ends, so no save reads its stream mid-change."""
        self._admitting = True
        lock = self.tenants.lock(job.tenant)
        lock.acquire()
        try:
            stream = self.tenants.stream(job.tenant)
            if not job.learn:  # a copy of the stream itself: it has no parent to merge into
                proposer = copy.deepcopy(stream)
            else:
                proposer = stream.fork_request() if self._in_flight.get(job.tenant) else stream
            if proposer.wants_cost and self.batch.cost is None:
                self.batch.cost = self.target.verify_cost()
            lane = (self.target.fork() if self.batch.max_batch > 1 else None) or self.target
            lane.prefix_scope = job.tenant  # no tenant's prefill time depends on another's prompts
            decoding = Decoding(lane, proposer, job.inputs, max_new_tokens=job.max_tokens,
                                sampling=job.sampling, cost=self.batch.cost if proposer.wants_cost else None)
        except BaseException:
            lock.release()
            raise
        finally:
            self._admitting = False
        self._in_flight[job.tenant] = self._in_flight.get(job.tenant, 0) + 1
        self._active[decoding] = _Active(job, decoding, IncrementalDetokenizer(self.target.tokenizer),
                                         StopStrings(job.stop) if job.stop else None)
        self.batch.add(decoding)

    def _on_event(self, event: BatchEvent) -> None:
        active = self._active.get(event.decoding)
        if active is None:
            return
        if event.error is not None:
            log.error("request failed", exc_info=event.error)
            self._end(active, {"type": "error", "message": "internal server error", "status": 500})
            return
        step = event.step
        delta, drafted_text = active.detokenizer.add(step.tokens, step.drafted)
        stopped = False
        if active.stops is not None:
            delta, stopped = active.stops.feed(delta)
            drafted_text = drafted_text[:len(delta)]
        if delta:
            active.job.emit({"type": "text", "text": delta, "drafted_text": drafted_text,
                             "tokens": len(step.tokens), "drafted": step.drafted})
        if stopped and not event.finished:
            self.batch.cancel(active.decoding)
        if stopped or event.finished:
            self._end(active, self._done(active, stopped))

    def _check_limits(self) -> None:
        """Between steps: cancelled requests (client gone, shutdown) and those past their time
        limit leave the batch."""
        now = time.monotonic()
        for active in list(self._active.values()):
            if now > self._drain_deadline or self._cancel_current:  # the server is going down: 503, not 499
                event = dict(SHUTTING_DOWN)
            elif active.job.cancelled.is_set():
                event = {"type": "error", "message": "the request was cancelled", "status": 499}
            elif now > active.job.deadline:
                event = {"type": "error", "message": "the request ran past the server's time limit", "status": 504}
            else:
                continue
            event["completion_tokens"] = len(active.decoding.result.tokens)  # work no one will read
            self.batch.cancel(active.decoding)
            self._end(active, event)

    def _done(self, active: _Active, stopped: bool = False) -> dict[str, Any]:
        """The final event; ``stopped``: a stop string ended the answer (its text is what the
        stop matcher let through)."""
        result, stops = active.decoding.result, active.stops
        if not stopped:
            rest, drafted_text, text = active.detokenizer.finish()  # what was held back, or a late spelling
            if stops is not None:
                rest, stopped = stops.feed(rest)
                if not stopped:
                    tail, stopped = stops.flush()
                    rest += tail
                drafted_text, text = drafted_text[:len(rest)], stops.text
            if rest:
                active.job.emit({"type": "text", "text": rest, "drafted_text": drafted_text, "tokens": 0,
                                 "drafted": 0})
        else:
            text = stops.text
        accepted = sum(it.accepted for it in result.iterations)
        return {
            "type": "done", "text": text, "stop_reason": "stop" if stopped else result.stop_reason,
            "usage": {"prompt_tokens": result.prompt_len, "completion_tokens": len(result.tokens),
                      "total_tokens": result.prompt_len + len(result.tokens)},
            "recap": {"method": self.tenants.method, "tau": round(result.tau, 4),
                      "iterations": len(result.iterations),
                      "drafted_tokens": sum(it.draft_size for it in result.iterations),
                      "accepted_tokens": accepted, "seconds": round(result.total_s, 4)},
        }

    def _end(self, active: _Active, event: dict[str, Any]) -> None:
        """A request has left the batch (its lane freed): hand a copy of its tenant's memory to
        the saver (written off this thread, `recap.serve.saver`), then answer."""
        job = active.job
        self._active.pop(active.decoding, None)
        self._in_flight[job.tenant] -= 1
        if not self._in_flight[job.tenant]:
            del self._in_flight[job.tenant]
        try:  # a copy, with the lock held: what the request learned, on disk within the saver's lag
            if job.learn:
                self.tenants.save_request(job.tenant, job.request_id)
        except Exception:  # noqa: BLE001
            log.exception("tenant %s: saving its memory failed", job.tenant)
        finally:
            self.tenants.lock(job.tenant).release()
        self._finish(job, event)

    def _finish(self, job: Job, event: dict[str, Any]) -> None:
        """Answer the job and report it; a failing callback (a client's loop already closed,
        a metric) is logged, never the end of the decoding thread."""
        try:
            job.emit(event)
            if self.on_finish is not None:
                self.on_finish(job, event)
        except Exception:  # noqa: BLE001 - the worker must survive any request
            log.exception("answering a finished request failed")
