"""Continuous batching: many requests decoded step by step, every step one forward.

Each request is a `Decoding` on its own lane (`TargetModel.fork`) with its own proposer. A
`Batch` steps them together:

1. **admit**: a waiting request joins. On the fast kernels its prompt is prefilled in chunks
   that ride in the coming steps' forwards (``prefill_rows`` rows per step in all, so a
   newcomer holds the running requests back by one chunk per step, never by its whole
   prompt; an image's vision tower runs first, at admission unless the caller ran
   ``target.encode_images`` already); on the stock kernels a prompt runs whole,
   ``prefills_per_step`` per step at most. Its first token is its first event;
2. **draft**: every running request drafts. Cost-aware proposers `offer` their candidates
   best first, and one budget is shared by expected gain (`share_budget`: the node set that
   maximises expected committed tokens per second of the whole step under t(total rows));
   the other methods size their own trees as they do alone;
3. **verify**: all trees in one forward (`verify_batch`; on the fast kernels a request's
   logits are bit-identical to decoding it alone, whatever else is in the batch);
4. **finish**: each request commits, learns and reports its step on its own; finished or
   failed requests leave and free their lane.

`generate_batch` is the offline entry point; `recap serve` steps a `Batch` from its decoder
thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image

from recap.core import CostProfile, DraftTree
from recap.core.chooser import share_budget
from recap.decoding import DecodeStep, Decoding, GenerationResult
from recap.errors import InputError
from recap.proposers import Proposer, make_proposer
from recap.verifier import TargetModel
from recap.verifier.batch import StepBatch, StepRequest, verify_batch
from recap.verifier.sampling import Sampling

PREFILL_ROWS_PER_STEP = 32
"""Prompt rows of newcomers computed per step beside the running requests' trees: how long a
prefill holds the others back (a 32-row chunk adds roughly what 32 draft nodes cost)."""
DEFAULT_MAX_BATCH = 8
"""Requests stepped together by default: on a CPU the linear layers of up to about 8-16 rows
cost little more than one (docs/kernels.md), and each request adds its own attention."""


@dataclass(frozen=True)
class BatchEvent:
    """What one request got from a batch step: a `DecodeStep`, or the error that ended it."""

    decoding: Decoding
    step: DecodeStep | None = None
    error: BaseException | None = None
    finished: bool = False
    """The request left the batch with this event (done or failed). Fixed when the event is
    made, not read from the decoding later: a step can give one request two events (its
    prefill's first token, then its first verification), and the first must not report the
    end the second brings, or a reader that stops at it loses the second's tokens."""


class Batch:
    """Requests decoded together on one target (see the module docstring)."""

    def __init__(self, *, max_batch: int = DEFAULT_MAX_BATCH, cost: CostProfile | None = None,
                 shared_budget: bool = True, prefill_rows: int = PREFILL_ROWS_PER_STEP,
                 prefills_per_step: int = 1):
        if max_batch < 1 or prefill_rows < 1 or prefills_per_step < 1:
            raise InputError(f"max_batch, prefill_rows and prefills_per_step must be at least 1, got {max_batch}, "
                             f"{prefill_rows}, {prefills_per_step}")
        self.max_batch = max_batch
        self.cost = cost
        """The step's cost profile t(rows): prices the shared budget; corrected online by
        every batched step's measured time."""
        self.shared_budget = shared_budget
        self.prefill_rows = prefill_rows
        self.prefills_per_step = prefills_per_step
        self.waiting: deque[Decoding] = deque()
        self.prefilling: dict[Decoding, Any] = {}
        """Admitted requests whose prompt is being prefilled in chunks, oldest first."""
        self.running: list[Decoding] = []
        self.steps = 0
        self.rows: deque[int] = deque(maxlen=4096)
        """Packed rows of the latest steps (roots and prefill chunks included), for reports."""
        self.peak_running = 0
        """The most requests one step has verified together."""
        self.host_s = 0.0
        """Seconds a step spends besides its forward (every request's drafting and learning),
        a running mean: the shared budget prices a step as t(rows) plus this."""

    def __len__(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    def _members(self) -> tuple[Decoding, ...]:
        return (*self.waiting, *self.prefilling, *self.running)

    def add(self, decoding: Decoding) -> None:
        """Queue a request; it joins at a coming step. Requests on lanes of their own
        (`TargetModel.fork`) run together; one whose target a running request uses waits
        for it (first come, first served)."""
        if decoding in self._members():
            raise InputError("this request is in the batch already")
        self.waiting.append(decoding)

    def cancel(self, decoding: Decoding) -> None:
        """Remove a request now and free its lane (its result keeps what it had)."""
        if decoding in self.waiting:
            self.waiting.remove(decoding)
        self._leave(decoding)

    def close(self) -> None:
        """Cancel everything (also after an error)."""
        for decoding in self._members():
            decoding.close()
        self.waiting.clear()
        self.prefilling.clear()
        self.running.clear()

    def step(self) -> list[BatchEvent]:
        """Admit, draft, verify (with this step's prefill chunks) and finish once; the events
        of every request that got a token or an error. A failing request (its prefill, proposer
        or inputs) leaves with its error, the others go on; an error of the shared forward
        itself is raised."""
        events = self._admit()
        begun = time.perf_counter()
        chunks = self._chunks()
        prefill_rows = sum(rows for _, rows in chunks)
        trees = self._draft(events, prefill_rows) if self.running else []
        running = self.running
        if not running and not chunks:
            return events
        t0 = time.perf_counter()
        try:
            verified: list = verify_batch(StepBatch(
                [StepRequest(d.target, d.history[-1], tree, d.sampler, len(d.result.tokens))
                 for d, tree in zip(running, trees)],
                [(self.prefilling[d], rows) for d, rows in chunks]))
            shared = True
        except Exception:
            if len(running) + len(chunks) < 2:
                raise  # its own forward: the caller ends it
            verified, shared = self._verify_alone(running, trees, chunks, events), False
            running = [d for d, v in zip(running, verified) if v is not None]
            verified = [v for v in verified if v is not None]
            chunks = [(d, rows) for d, rows in chunks if d in self.prefilling]
        seconds = time.perf_counter() - t0
        rows = sum(len(tree) + 1 for tree in trees) + prefill_rows
        if self.cost is not None and running and shared:  # a step run lane by lane is not a step's cost
            self.cost.observe(rows, self._context(), seconds)
        self.steps += 1
        self.rows.append(rows)
        self.peak_running = max(self.peak_running, len(running))
        for decoding, step in zip(list(running), verified):
            try:
                taken = decoding.finish(step, observe_cost=False)
                events.append(BatchEvent(decoding, step=taken, finished=decoding.done))
            except Exception as error:  # noqa: BLE001 - one request's failure must not end the others
                events.append(self._fail(decoding, error))
                continue
            if decoding.done:
                self._leave(decoding)
        if running:  # what the step cost besides its forward: drafting, learning, bookkeeping
            host = time.perf_counter() - begun - seconds
            self.host_s = host if self.steps == 1 else 0.8 * self.host_s + 0.2 * host
        for decoding, _ in chunks:
            chunked = self.prefilling[decoding]
            if chunked.finished:
                del self.prefilling[decoding]
                events.append(self._start(decoding, chunked))
        return events

    def _verify_alone(self, running: Sequence[Decoding], trees: Sequence[DraftTree],
                      chunks: Sequence[tuple[Decoding, int]], events: list[BatchEvent]) -> list:
        """The shared forward failed: each request verified (or its prefill chunk run) alone, so
        only the one whose own forward fails leaves, with its error, and the others go on with
        the very logits the shared step would have given them (the kernels are
        batch-invariant; nothing is committed until `Decoding.finish`). Returns each running
        request's verification, None for one that failed."""
        verified: list = []
        for decoding, tree in zip(running, trees):
            try:
                verified += verify_batch(StepBatch([StepRequest(decoding.target, decoding.history[-1], tree,
                                                                decoding.sampler, len(decoding.result.tokens))]))
            except Exception as error:  # noqa: BLE001 - one request's failure must not end the others
                events.append(self._fail(decoding, error))
                verified.append(None)
        for decoding, rows in chunks:
            try:
                verify_batch(StepBatch(prefills=[(self.prefilling[decoding], rows)]))
            except Exception as error:  # noqa: BLE001
                events.append(self._fail(decoding, error))
        return verified

    def _context(self) -> int:
        """Mean cached tokens of the running requests: the context the step's cost is read at."""
        return sum(d.target.past_len for d in self.running) // max(1, len(self.running))

    def _admit(self) -> list[BatchEvent]:
        """Newcomers join while there is room: a chunked prefill starts (its rows run inside
        the coming steps), a whole one (the stock kernels) runs now, at most
        ``prefills_per_step`` of those per step."""
        events, whole = [], 0
        while self.waiting and len(self.running) + len(self.prefilling) < self.max_batch and \
                whole < self.prefills_per_step:
            decoding = self.waiting[0]
            if any(d.target is decoding.target for d in (*self.prefilling, *self.running)):
                break
            self.waiting.popleft()
            try:
                chunked = decoding.open_prefill()
            except Exception as error:  # noqa: BLE001
                events.append(self._fail(decoding, error))
                continue
            if chunked is not None:
                self.prefilling[decoding] = chunked
            else:
                whole += 1
                events.append(self._start(decoding))
        return events

    def _start(self, decoding: Decoding, chunked: Any | None = None) -> BatchEvent:
        """The request's first token (its prefill done): it runs from the next step on."""
        self.running.append(decoding)
        try:
            first = decoding.start(chunked)
            event = BatchEvent(decoding, step=first, finished=decoding.done)
        except Exception as error:  # noqa: BLE001
            return self._fail(decoding, error)
        if decoding.done:
            self._leave(decoding)
        return event

    def _chunks(self) -> list[tuple[Decoding, int]]:
        """This step's prefill rows, oldest request first, ``prefill_rows`` in all."""
        chunks, budget = [], self.prefill_rows
        for decoding, chunked in self.prefilling.items():
            if budget <= 0:
                break
            rows = min(budget, chunked.left)
            chunks.append((decoding, rows))
            budget -= rows
        return chunks

    def _draft(self, events: list[BatchEvent], prefill_rows: int = 0) -> list:
        """Every running request's tree: offers share one budget (the step's prefill rows
        counted as fixed), the rest propose alone."""
        trees, offers = {}, {}
        for decoding in list(self.running):
            try:
                offer = decoding.proposer.offer(decoding.history, decoding.limits) \
                    if self.shared_budget and self.cost is not None else None
                if offer is None:
                    trees[decoding] = decoding.propose()
                else:
                    offers[decoding] = offer
            except Exception as error:  # noqa: BLE001
                events.append(self._fail(decoding, error))
        if offers:
            fixed = sum(len(tree) + 1 for tree in trees.values()) + len(offers) + prefill_rows
            sizes = share_budget([offer.gains for offer in offers.values()], fixed, len(offers) + len(trees),
                                 self.cost, self._context(), self.host_s, prefill_rows)
            for (decoding, offer), size in zip(offers.items(), sizes):
                try:
                    trees[decoding] = decoding.propose(offer.take(size))
                except Exception as error:  # noqa: BLE001
                    events.append(self._fail(decoding, error))
        self.running = [d for d in self.running if d in trees]
        return [trees[d] for d in self.running]

    def _leave(self, decoding: Decoding) -> None:
        if decoding in self.running:
            self.running.remove(decoding)
        self.prefilling.pop(decoding, None)
        decoding.close()

    def _fail(self, decoding: Decoding, error: BaseException) -> BatchEvent:
        """One request's failure: it leaves the batch with its error, the others go on."""
        self._leave(decoding)
        return BatchEvent(decoding, error=error, finished=True)


def generate_batch(target: TargetModel, prompts: Sequence[str | list[dict]], *,
                   images: Sequence[Image.Image | None] | None = None, method: str = "recap",
                   proposers: Sequence[Proposer] | None = None, max_new_tokens: int = 128,
                   max_batch: int = DEFAULT_MAX_BATCH, shared_budget: bool = True,
                   temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                   seed: int | None = None, progress: bool = True) -> list[GenerationResult]:
    """Decode many prompts with continuous batching: each result (tokens and text) is what
    `recap.generate` gives the prompt alone. ``method`` makes one fresh proposer per prompt
    (or pass ``proposers``, one per prompt: distinct objects, each a stream of its own).
    Up to ``max_batch`` requests share each forward; on the stock kernels they are verified
    one after another. A progress bar counts finished requests unless ``progress`` is off."""
    images = list(images) if images is not None else [None] * len(prompts)
    if len(images) != len(prompts):
        raise InputError(f"{len(prompts)} prompts but {len(images)} images")
    if proposers is None:
        proposers = [make_proposer(method) for _ in prompts]
    if len(proposers) != len(prompts) or len({id(p) for p in proposers}) != len(proposers):
        raise InputError("give one distinct proposer per prompt")
    sampling = Sampling.of(temperature, top_k, top_p, seed)
    cost = target.verify_cost() if any(p.wants_cost for p in proposers) else None
    batch = Batch(max_batch=max_batch, cost=cost, shared_budget=shared_budget)
    decodings = []
    for prompt, image, proposer in zip(prompts, images, proposers):
        decoding = Decoding(target.fork(), proposer, target.prepare(prompt, image), max_new_tokens=max_new_tokens,
                            cost=cost, sampling=sampling)
        decodings.append(decoding)
        batch.add(decoding)
    from tqdm.auto import tqdm

    bar = tqdm(total=len(decodings), desc="generate_batch", unit="req", disable=not progress)
    try:
        while len(batch):
            for event in batch.step():
                if event.error is not None:
                    raise event.error
                if event.finished:
                    bar.update(1)
    finally:
        batch.close()
        bar.close()
    for decoding in decodings:
        decoding.result.text = target.tokenizer.decode(decoding.result.tokens, skip_special_tokens=True)
    return [decoding.result for decoding in decodings]
