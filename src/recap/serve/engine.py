"""One model, one request at a time: a FIFO queue in front of a single decoding thread.

The HTTP side submits a `Job` (already validated: its inputs prepared) and reads its events;
the worker runs the job's `Decoding` step by step, turns each step into text, and checks
between steps whether the job was cancelled (client gone, time limit, shutdown). Whatever
happens, `Decoding` frees the KV cache and the tenant's memory is saved after the request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from recap.decoding import Decoding
from recap.serve.tenants import TenantStreams
from recap.target import ModelInputs, TargetModel
from recap.target.sampling import Sampling

log = logging.getLogger("recap.serve")


class QueueFull(Exception):
    """The queue holds ``max_queue`` waiting requests already."""


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
        self.tenants.save_all()

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
            except Exception as error:  # noqa: BLE001 - the worker must survive any request
                log.exception("request failed")
                event = {"type": "error", "message": f"internal error: {type(error).__name__}", "status": 500}
            try:  # before answering: an answered request's memory is on disk
                self.tenants.save(job.tenant)
            except Exception:  # noqa: BLE001
                log.exception("tenant %s: saving its memory failed", job.tenant)
            self.busy = False
            self._finish(job, event)

    def _serve(self, job: Job) -> dict[str, Any]:
        """Decode one job, emitting its text as it comes; return its final event."""
        tokenizer = self.target.tokenizer
        proposer = self.tenants.stream(job.tenant)
        decoding = Decoding(self.target, proposer, job.inputs, max_new_tokens=job.max_tokens, sampling=job.sampling)
        steps = iter(decoding)
        tokens: list[int] = []
        sent = ""
        reason = None
        try:
            for step in steps:
                drafted_upto = len(tokens) + step.drafted
                tokens.extend(step.tokens)
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                # an unfinished character (or a re-spelled prefix) waits for the next step
                if not text.endswith("\ufffd") and text.startswith(sent) and len(text) > len(sent):
                    drafted_text = tokenizer.decode(tokens[:drafted_upto], skip_special_tokens=True)
                    delta = text[len(sent):]
                    drafted_chars = max(0, min(len(delta), len(drafted_text) - len(sent)))
                    sent = text
                    job.emit({"type": "text", "text": delta, "drafted_text": delta[:drafted_chars],
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
        text = tokenizer.decode(result.tokens, skip_special_tokens=True)
        if reason is None and text != sent and text.startswith(sent):
            job.emit({"type": "text", "text": text[len(sent):], "drafted_text": "", "tokens": 0, "drafted": 0})
        if reason == "cancelled":
            return {"type": "error", "message": "the request was cancelled", "status": 499}
        if reason == "timeout":
            return {"type": "error", "message": "the request ran past the server's time limit", "status": 504}
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
