"""The decoding loop: propose -> verify -> commit -> observe, until EOS or the token limit.

Greedy autoregressive decoding is the same loop with an empty tree, so AR and every drafter
share prefill, verification and timing code.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from PIL import Image

from recap.core import CostProfile, StepLimits
from recap.errors import InputError
from recap.proposers import Proposer, make_proposer
from recap.target import ModelInputs, TargetModel


@dataclass(frozen=True)
class IterationStats:
    """One verification: tree size (root excluded), draft tokens accepted, and where the
    time went."""

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


def decode(target: TargetModel, proposer: Proposer, inputs: ModelInputs, *, max_new_tokens: int = 128,
           eos_token_ids: Sequence[int] | None = None, cost: CostProfile | None = None) -> GenerationResult:
    """Greedy generation of at most ``max_new_tokens`` tokens, stopping after any EOS token.
    The output equals ``model.generate(do_sample=False)``; the proposer only changes speed.

    A cost-aware proposer (``wants_cost``) sizes each tree with ``cost``, by default the
    target's own verify-cost profile (`TargetModel.verify_cost`: cached, or measured once);
    every verification's measured time then corrects that profile online."""
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    window = getattr(target, "sliding_window", None)
    if window is not None and inputs.input_ids.shape[1] + max_new_tokens > window:
        raise InputError(f"prompt ({inputs.input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"the model's sliding attention window of {window} tokens, beyond which tree verification "
                         "is not exact")
    eos = frozenset(target.eos_token_ids if eos_token_ids is None else eos_token_ids)
    capture = getattr(target, "capture_image_attention", None)
    if capture is not None:  # only proposers that gate on it (sam-viskip) pay for the measurement
        capture(bool(getattr(proposer, "wants_image_attention", False)))
    if cost is None and getattr(proposer, "wants_cost", False) and hasattr(target, "verify_cost"):
        cost = target.verify_cost()
    clock = time.perf_counter
    start = clock()
    rows, first = target.prefill(inputs)
    proposer.begin_request(rows)
    history = rows.ids.tolist() + [first]
    result = GenerationResult(tokens=[first], prompt_len=len(rows.ids), prefill_s=clock() - start, total_s=0.0)
    done = first in eos or max_new_tokens == 1
    if first in eos:
        result.stop_reason = "eos"
    while not done:
        t0 = clock()
        context_len = target.past_len
        tree = proposer.propose(history, StepLimits(cost=cost, context_len=context_len))
        t1 = clock()
        step = target.verify(history[-1], tree)
        committed = step.committed
        room = max_new_tokens - len(result.tokens)
        taken = committed[:room]
        for i, token in enumerate(taken):
            if token in eos:
                taken = taken[: i + 1]
                result.stop_reason = "eos"
                break
        done = result.stop_reason == "eos" or len(taken) == room
        if not done:
            target.commit(step.accepted)
        t2 = clock()
        if cost is not None:
            cost.observe(len(tree) + 1, context_len, t2 - t1)
        if len(taken) < len(committed):  # tokens past EOS or the limit are never learned
            step = replace(step, kept=len(taken))
        proposer.observe(step)
        t3 = clock()
        result.cut_inside_path |= len(taken) < len(committed)
        result.tokens.extend(taken)
        history.extend(taken)
        result.iterations.append(IterationStats(len(tree), len(step.accepted), t1 - t0, t2 - t1, t3 - t2))
    proposer.end_request()
    target.release()
    result.total_s = clock() - start
    return result


def generate(target: TargetModel, prompt: str | list[dict], *, image: Image.Image | None = None,
             method: str | Proposer = "recap", max_new_tokens: int = 128) -> GenerationResult:
    """Prepare the prompt (and image), decode with ``method``, and decode the text."""
    proposer = make_proposer(method) if isinstance(method, str) else method
    inputs = target.prepare(prompt, image)
    result = decode(target, proposer, inputs, max_new_tokens=max_new_tokens)
    result.text = target.tokenizer.decode(result.tokens, skip_special_tokens=True)
    return result
