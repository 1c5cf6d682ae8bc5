"""Losslessness check: a method's output against ``model.generate(do_sample=False)``.

Used by ``recap check`` and by the test suite. With ``vary=True`` each case also draws its
own token limit and, for half of the cases, an EOS token taken from the middle of the
reference output, so generation stops inside accepted draft paths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from recap.decoding import decode, reference_generate
from recap.prompts import check_prompts
from recap.proposers import Proposer, make_proposer
from recap.verifier import TargetModel


def claims_exact(dtype: str, kernels: str) -> bool:
    """Whether a method's output must equal the reference token for token. On the fast
    kernels always: every kernel is batch-invariant, so a verify's logits are a plain step's
    bits in any weight dtype. On stock kernels in float32 only: bfloat16 / float16 forwards of
    several tokens round otherwise than one-token ones, so near-ties may flip (an agreement
    rate, never called exact)."""
    return kernels == "fast" or dtype == "float32"


@dataclass(frozen=True)
class CheckCase:
    index: int
    prompt: str
    has_image: bool
    max_new_tokens: int
    eos_token_ids: list[int]
    reference: list[int]
    output: list[int]
    tau: float
    cut_inside_path: bool
    stop_reason: str
    accepted: int = 0
    """Draft tokens the target accepted over the case's verifications (0: nothing drafted
    was ever checked against the reference, whatever ``passed`` says)."""

    @property
    def passed(self) -> bool:
        return self.output == self.reference

    @property
    def first_difference(self) -> int | None:
        """Index of the first differing token (or the shorter length), None when equal."""
        for i, (a, b) in enumerate(zip(self.reference, self.output)):
            if a != b:
                return i
        return None if self.passed else min(len(self.reference), len(self.output))

    @property
    def agreeing_tokens(self) -> int:
        """Reference tokens reproduced before the first difference."""
        difference = self.first_difference
        return len(self.reference) if difference is None else difference


@dataclass(frozen=True)
class CheckReport:
    method: str
    cases: list[CheckCase]

    @property
    def passed(self) -> int:
        return sum(case.passed for case in self.cases)

    @property
    def failed(self) -> int:
        return len(self.cases) - self.passed

    @property
    def agreement_rate(self) -> float:
        """Share of prompts whose whole output equals the reference."""
        return self.passed / len(self.cases) if self.cases else 1.0

    @property
    def token_agreement_rate(self) -> float:
        """Share of reference tokens reproduced before each prompt's first difference."""
        total = sum(len(case.reference) for case in self.cases)
        return sum(case.agreeing_tokens for case in self.cases) / total if total else 1.0

    @property
    def tau(self) -> float:
        return float(np.mean([case.tau for case in self.cases])) if self.cases else 1.0

    @property
    def accepted(self) -> int:
        """Draft tokens accepted over every case."""
        return sum(case.accepted for case in self.cases)


def run_check(target: TargetModel, method: str | Proposer, *, prompts: int = 30, max_new_tokens: int = 48,
              vary: bool = False, seed: int = 0, on_case: Callable[[CheckCase], None] | None = None,
              items: Sequence[tuple[str, Image.Image | None]] | None = None,
              reference: TargetModel | None = None) -> CheckReport:
    """Run ``prompts`` built-in prompts (with images when the target takes them), or the
    given (prompt, image) ``items``, through ``method`` and through greedy ``generate``; one
    proposer serves all prompts (a stream). ``reference``: the target whose plain greedy
    output the method must equal (default ``target`` itself; `recap check` passes the same
    model on its float weights when ``target`` reads GGUF blocks as stored)."""
    reference_target = target if reference is None else reference
    proposer = make_proposer(method) if isinstance(method, str) else method
    rng = np.random.default_rng(seed)
    cases = []
    if items is None:
        items = list(check_prompts(prompts, images=target.accepts_images))
    for index, (prompt, image) in enumerate(items):
        inputs = target.prepare(prompt, image)
        limit = int(rng.integers(4, max_new_tokens + 1)) if vary else max_new_tokens
        eos = target.eos_token_ids
        reference = reference_generate(reference_target, inputs, limit, eos)
        if vary and index % 2 == 1 and len(reference) > 2:
            eos = [reference[int(rng.integers(1, len(reference) - 1))]]
            reference = reference_generate(reference_target, inputs, limit, eos)
        proposer.set_reference(inputs.prompt_ids + reference)  # only oracle test drafters read it
        result = decode(target, proposer, inputs, max_new_tokens=limit, eos_token_ids=eos)
        case = CheckCase(index=index, prompt=prompt, has_image=image is not None, max_new_tokens=limit,
                         eos_token_ids=list(eos), reference=reference, output=result.tokens, tau=result.tau,
                         cut_inside_path=result.cut_inside_path, stop_reason=result.stop_reason,
                         accepted=sum(it.accepted for it in result.iterations))
        cases.append(case)
        if on_case is not None:
            on_case(case)
    name = method if isinstance(method, str) else getattr(method, "name", type(method).__name__)
    return CheckReport(method=name, cases=cases)
