"""The decoding loop: propose -> verify -> commit -> observe, until EOS or the token limit,
as an iterator of steps (`Decoding`) so streaming, cancelling and `decode` share one loop.

Greedy autoregressive decoding is the same loop with an empty tree, so AR and every drafter
share prefill, verification and timing code.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from PIL import Image

from recap.core import CostProfile, DraftTree, StepLimits, VerifiedTree
from recap.errors import InputError
from recap.proposers import Proposer, make_proposer
from recap.verifier import ModelInputs, Target, TargetModel
from recap.verifier.sampling import Sampler, Sampling


@dataclass(frozen=True)
class IterationStats:
    """One verification: tree size (root excluded), draft tokens accepted into the output
    (accepted drafts past EOS or the token limit not counted, so tau is output tokens per
    step), and where the time went."""

    draft_size: int
    accepted: int
    propose_s: float
    verify_s: float
    observe_s: float


@dataclass
class GenerationResult:
    tokens: list[int]
    """Generated token ids (the EOS token, if one was produced, included)."""
    prompt_len: int
    prefill_s: float
    total_s: float
    iterations: list[IterationStats] = field(default_factory=list)
    stop_reason: str = "length"
    """``eos`` or ``length``."""
    cut_inside_path: bool = False
    """True when EOS or the token limit landed inside an accepted path (tokens dropped)."""
    text: str = ""

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification: 1 + mean accepted draft tokens."""
        if not self.iterations:
            return 1.0
        return 1.0 + sum(it.accepted for it in self.iterations) / len(self.iterations)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.total_s if self.total_s > 0 else 0.0

    def timings(self) -> dict[str, float]:
        return {
            "prefill_s": self.prefill_s,
            "propose_s": sum(it.propose_s for it in self.iterations),
            "verify_s": sum(it.verify_s for it in self.iterations),
            "observe_s": sum(it.observe_s for it in self.iterations),
            "total_s": self.total_s,
        }


@dataclass(frozen=True)
class DecodeStep:
    """What one step gave the user: the prefill's first token, then each verification's."""

    tokens: list[int]
    """Tokens committed by this step, in order (never past EOS or the token limit)."""
    drafted: int
    """How many of ``tokens`` (the first ones) were drafted and accepted; the rest, one at
    most, is the target's own next token."""
    iteration: IterationStats | None
    """The verification's statistics; None for the prefill's token."""


class Decoding:
    """One request's decoding loop as an iterator of `DecodeStep`: what streaming, `decode`,
    `generate` and the CLI all run. ``result`` grows as steps are taken and is complete once
    the iterator is exhausted. Leaving early (``break``, ``close()``, an error, a cancelled
    request) still frees the KV cache and ends the proposer's request.

    The loop uses only what `recap.verifier.protocol.Target` and `recap.proposers.Proposer`
    declare (context limit, sliding window, sampling, image-attention capture, cost profile,
    ``wants_cost``, ``wants_image_attention``, ``rows_wanted``): any target and proposer that conform run here."""

    def __init__(self, target: Target, proposer: Proposer, inputs: ModelInputs | Sequence[int], *,
                 max_new_tokens: int = 128, eos_token_ids: Sequence[int] | None = None,
                 cost: CostProfile | None = None, sampling: Sampling | None = None):
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if sampling is not None and not target.can_sample:
            raise InputError(f"{type(target).__name__} decodes greedily only: it cannot sample")
        prompt_len = target.prompt_length(inputs)
        window = target.sliding_window
        if window is not None and prompt_len + max_new_tokens > window:
            raise InputError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"model's sliding attention window of {window} tokens, beyond which tree verification "
                             "is not exact")
        max_context = target.max_context
        if max_context is not None and prompt_len + max_new_tokens > max_context:
            raise InputError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"model's context of {max_context} tokens")
        self.target, self.proposer, self.inputs = target, proposer, inputs
        self.max_new_tokens = max_new_tokens
        self.eos = frozenset(target.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.cost = cost
        self.sampler = Sampler(sampling, max_new_tokens) if sampling is not None else None
        self.result = GenerationResult(tokens=[], prompt_len=prompt_len, prefill_s=0.0, total_s=0.0)
        self.history: list[int] = []
        self.done = False
        """True once EOS or the token limit is reached (no further step)."""
        self._begun = self._closed = False
        self._start = 0.0
        self._proposed_at = self._propose_s = 0.0
        self._tree = DraftTree.empty()

    def __iter__(self) -> Iterator[DecodeStep]:
        return self._steps()

    def _steps(self) -> Iterator[DecodeStep]:
        try:
            yield self.start()
            while not self.done:
                tree = self.propose()
                verified = self.target.verify(self.history[-1], tree, self.sampler, len(self.result.tokens))
                yield self.finish(verified)
        finally:
            self.close()

    # The loop's parts, public so that `recap.batching` can verify many requests' trees in one
    # forward between ``propose`` and ``finish``: one request alone runs exactly these calls.
    def _prepare(self) -> None:
        """Before prefill: the image-attention capture the proposer asks for, its cost profile,
        and the request's clock."""
        target, proposer = self.target, self.proposer
        # only proposers that gate on it (sam-viskip) pay for the measurement
        target.capture_image_attention(proposer.wants_image_attention)
        # and only for the prompt rows it reads (recap and tree recycling: each token's first)
        target.keep_prompt_rows(proposer.rows_wanted)
        if self.cost is None and proposer.wants_cost:
            self.cost = target.verify_cost()  # None: the target has no profile, the proposer keeps its budget
        self._start = time.perf_counter()

    def open_prefill(self) -> Any | None:
        """Begin a prefill that a batch runs in chunks inside its steps (the target's
        ``prefill_chunks``), then finished by ``start(chunked)``; None: ``start()`` prefills."""
        self._prepare()
        return self.target.prefill_chunks(self.inputs)

    def start(self, chunked: Any | None = None) -> DecodeStep:
        """Prefill (or take the finished ``chunked`` one): the prompt's KV state and the first
        token; the proposer begins its request."""
        proposer, result = self.proposer, self.result
        if chunked is None:
            if not self._start:
                self._prepare()
            rows, first = self.target.prefill(self.inputs, self.sampler)
        else:
            rows, first = chunked.result(self.sampler)
        proposer.begin_request(rows)
        self._begun = True
        self.history = rows.ids.tolist() + [first]
        result.tokens.append(first)
        result.prefill_s = time.perf_counter() - self._start
        self.done = first in self.eos or self.max_new_tokens == 1
        if first in self.eos:
            result.stop_reason = "eos"
        return DecodeStep([first], 0, None)

    @property
    def limits(self) -> StepLimits:
        """What the coming step allows: the cost profile, the cached context, the tokens left,
        the tokens that would end the request."""
        return StepLimits(cost=self.cost, context_len=self.target.past_len,
                          remaining=self.max_new_tokens - len(self.result.tokens), stop_tokens=self.eos)

    def propose(self, tree: DraftTree | None = None) -> DraftTree:
        """The next step's draft tree, from the proposer (or ``tree``, already chosen for this
        request by a batch's shared budget), emptied where it would pass the model's context."""
        self._proposed_at = t0 = time.perf_counter()
        if tree is None:
            tree = self.proposer.propose(self.history, self.limits)
        max_context = self.target.max_context or 1 << 62
        if len(tree) and self.target.past_len + tree.max_depth >= max_context:
            tree = DraftTree.empty()  # drafts would need positions past the model's context
        self._tree = tree
        self._propose_s = time.perf_counter() - t0
        return tree

    def finish(self, step: VerifiedTree, *, observe_cost: bool = True) -> DecodeStep:
        """Take a verification of the proposed tree: cut at EOS or the token limit, commit the
        accepted nodes' KV entries, let the proposer learn, record the step. ``observe_cost``
        off: the caller times a shared (batched) step and corrects the profile itself."""
        target, result, tree = self.target, self.result, self._tree
        room = self.max_new_tokens - len(result.tokens)
        context_len = target.past_len
        committed = step.committed
        taken = committed[:room]
        for i, token in enumerate(taken):
            if token in self.eos:
                taken = taken[: i + 1]
                result.stop_reason = "eos"
                break
        self.done = result.stop_reason == "eos" or len(taken) == room
        if not self.done:
            target.commit(step.accepted)
        t2 = time.perf_counter()
        t1 = self._proposed_at + self._propose_s
        if observe_cost and self.cost is not None:
            self.cost.observe(len(tree) + 1, context_len, t2 - t1)
        if len(taken) < len(committed):  # tokens past EOS or the limit are never learned
            step = replace(step, kept=len(taken))
        self.proposer.observe(step)
        t3 = time.perf_counter()
        result.cut_inside_path |= len(taken) < len(committed)
        result.tokens.extend(taken)
        self.history.extend(taken)
        drafted = min(len(step.accepted), len(taken))  # accepted drafts past EOS or the limit are not output
        iteration = IterationStats(len(tree), drafted, self._propose_s, t2 - t1, t3 - t2)
        result.iterations.append(iteration)
        return DecodeStep(list(taken), drafted, iteration)

    def close(self) -> None:
        """End the proposer's request and free the KV cache (idempotent; also after an error)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._begun:
                self.proposer.end_request()
        finally:  # a proposer that fails to end its request must not keep the KV cache alive
            self.target.release()
            if self._start:
                self.result.total_s = time.perf_counter() - self._start


def decode(target: Target, proposer: Proposer, inputs: ModelInputs | Sequence[int], *, max_new_tokens: int = 128,
           eos_token_ids: Sequence[int] | None = None, cost: CostProfile | None = None,
           sampling: Sampling | None = None) -> GenerationResult:
    """Generation of at most ``max_new_tokens`` tokens, stopping after any EOS token. Greedy
    by default: the output equals ``model.generate(do_sample=False)``. With ``sampling`` each
    token is an exact draw from the target's processed distribution (`recap.verifier.sampling`),
    the same tokens for the same seed whatever the method. The proposer only changes speed.

    A cost-aware proposer (``wants_cost``) sizes each tree with ``cost``, by default the
    target's own verify-cost profile (`TargetModel.verify_cost`: cached, or measured once);
    every verification's measured time then corrects that profile online."""
    decoding = Decoding(target, proposer, inputs, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
                        cost=cost, sampling=sampling)
    for _ in decoding:
        pass
    return decoding.result


def generate(target: TargetModel, prompt: str | list[dict], *, image: Image.Image | None = None,
             method: str | Proposer = "recap", max_new_tokens: int = 128, temperature: float | None = None,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None) -> GenerationResult:
    """Prepare the prompt (and image), decode with ``method``, and decode the text. Greedy
    unless ``temperature`` > 0 (then ``top_k``, ``top_p`` and ``seed`` apply)."""
    sampling = Sampling.of(temperature, top_k, top_p, seed)
    proposer = make_proposer(method) if isinstance(method, str) else method
    inputs = target.prepare(prompt, image)
    result = decode(target, proposer, inputs, max_new_tokens=max_new_tokens, sampling=sampling)
    result.text = target.tokenizer.decode(result.tokens, skip_special_tokens=True)
    return result


def reference_generate(target: TargetModel, inputs: ModelInputs, max_new_tokens: int,
                       eos_token_ids: Sequence[int] | None = None) -> list[int]:
    """The greedy output every method must reproduce on this target's kernels: on ``stock``,
    ``model.generate(do_sample=False)`` (`TargetModel.stock_generate`); on ``fast``, plain
    one-token decoding on the same fast kernels (exact by construction, DESIGN.md 11)."""
    if target.kernels == "stock":
        return target.stock_generate(inputs, max_new_tokens, eos_token_ids)
    return decode(target, make_proposer("ar"), inputs, max_new_tokens=max_new_tokens,
                  eos_token_ids=eos_token_ids).tokens
