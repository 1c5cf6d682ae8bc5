"""One model, one request at a time: a FIFO queue in front of a single decoding thread.

The HTTP side submits a `Job` (already validated: its inputs prepared) and reads its events;
the worker runs the job's `Decoding` step by step, turns each step into text
(`IncrementalDetokenizer`), and checks between steps whether the job was cancelled (client
gone, time limit, shutdown). Whatever happens, `Decoding` frees the KV cache and the tenant's
memory is saved after the request; the worker holds the tenant's lock while the request
changes its stream, so a save (the shutdown's included) never reads a stream mid-change.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from recap.decoding import Decoding
from recap.serve.tenants import TenantStreams
from recap.target import ModelInputs, TargetModel
from recap.target.sampling import Sampling

log = logging.getLogger("recap.serve")


class QueueFull(Exception):
    """The queue holds ``max_queue`` waiting requests already."""


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
    deadline: float = float("inf")
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)

    def cancel(self) -> None:
        self.cancelled.set()


class Engine:
    """The decoding thread and its queue."""

    def __init__(self, target: TargetModel, tenants: TenantStreams, *, max_queue: int = 64,
                 on_finish: Callable[[Job, dict[str, Any]], None] | None = None):
        self.target = target
        self.tenants = tenants
        self.max_queue = max_queue
        self.on_finish = on_finish
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._waiting = 0
        self._lock = threading.Lock()
        self._accepting = True
        self.busy = False
        self._thread = threading.Thread(target=self._run, name="recap-decoder", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting (the one being decoded not counted)."""
        return self._waiting

    def submit(self, job: Job) -> None:
        with self._lock:
            if not self._accepting:
                raise QueueFull("the server is shutting down")
            if self._waiting >= self.max_queue:
                raise QueueFull(f"{self._waiting} requests are already waiting")
            self._waiting += 1
        self._queue.put(job)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, cancel the waiting ones, let the current one finish (or cancel it
        after ``timeout``), then save every tenant's memory."""
        with self._lock:
            self._accepting = False
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                self._finish(job, {"type": "error", "message": "the server is shutting down", "status": 503})
                with self._lock:
                    self._waiting -= 1
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the request in flight did not finish within %.0f s; cancelling it", timeout)
            self._cancel_current = True
            self._thread.join(timeout)
        # a decoder still running holds its tenant's lock: that tenant keeps its last saved file
        self.tenants.save_all(timeout=0.0 if self._thread.is_alive() else None)

    # ------------------------------------------------------------------ worker
    _cancel_current = False

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self._waiting -= 1
            if job.cancelled.is_set():
                self._finish(job, {"type": "error", "message": "cancelled before it started", "status": 499})
                continue
            self.busy = True
            try:
                event = self._serve(job)
            except Exception:  # noqa: BLE001 - the worker must survive any request
                log.exception("request failed")
                event = {"type": "error", "message": "internal server error", "status": 500}  # details: the log
            try:  # before answering: an answered request's memory is on disk
                self.tenants.save(job.tenant)
            except Exception:  # noqa: BLE001
                log.exception("tenant %s: saving its memory failed", job.tenant)
            self.busy = False
            self._finish(job, event)

    def _serve(self, job: Job) -> dict[str, Any]:
        """Decode one job, emitting its text as it comes; return its final event."""
        with self.tenants.lock(job.tenant):  # no save reads the stream while this request changes it
            detokenizer = IncrementalDetokenizer(self.target.tokenizer)
            proposer = self.tenants.stream(job.tenant)
            decoding = Decoding(self.target, proposer, job.inputs, max_new_tokens=job.max_tokens,
                                sampling=job.sampling)
            steps = iter(decoding)
            reason = None
            try:
                for step in steps:
                    delta, drafted_text = detokenizer.add(step.tokens, step.drafted)
                    if delta:
                        job.emit({"type": "text", "text": delta, "drafted_text": drafted_text,
                                  "tokens": len(step.tokens), "drafted": step.drafted})
                    if job.cancelled.is_set() or self._cancel_current:
                        reason = "cancelled"
                        break
                    if time.monotonic() > job.deadline:
                        reason = "timeout"
                        break
            finally:
                steps.close()
        result = decoding.result
        if reason == "cancelled":
            return {"type": "error", "message": "the request was cancelled", "status": 499}
        if reason == "timeout":
            return {"type": "error", "message": "the request ran past the server's time limit", "status": 504}
        rest, drafted_text, text = detokenizer.finish()  # what was held back, or a tokenizer's late spelling
        if rest:
            job.emit({"type": "text", "text": rest, "drafted_text": drafted_text, "tokens": 0, "drafted": 0})
        accepted = sum(it.accepted for it in result.iterations)
        return {
            "type": "done", "text": text, "stop_reason": result.stop_reason,
            "usage": {"prompt_tokens": result.prompt_len, "completion_tokens": len(result.tokens),
                      "total_tokens": result.prompt_len + len(result.tokens)},
            "recap": {"method": self.tenants.method, "tau": round(result.tau, 4),
                      "iterations": len(result.iterations),
                      "drafted_tokens": sum(it.draft_size for it in result.iterations),
                      "accepted_tokens": accepted, "seconds": round(result.total_s, 4)},
        }

    def _finish(self, job: Job, event: dict[str, Any]) -> None:
        job.emit(event)
        if self.on_finish is not None:
            self.on_finish(job, event)
