"""Sampling settings, and the draws that keep tree verification exact under sampling.

Verification under sampling: walking from the root, each reached packed position draws one
token from the target's *processed* distribution there (transformers' own warpers:
temperature, then top-k, then top-p, the order `generate(do_sample=True)` applies them); a
child holding the draw is accepted and the walk moves on, otherwise the draw is the step's own
token. Each committed token is then a draw from the target's conditional given the tokens
before it, as in plain sampling; drafts never bias it because no draw is repeated or
redirected (see `Sampler`).

Processors that depend on the sequence (repetition penalty, no-repeat n-grams...) would need
each node's own path; they are refused (`SamplingError`), not silently misapplied.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from recap.errors import InputError


class SamplingError(InputError):
    """Sampling settings RECAP cannot honour exactly; the message says why."""


MIN_TEMPERATURE = 1e-6
"""Smallest sampling temperature: below it a draw is greedy's token anyway, and far below
(~1e-308) logits / temperature overflow and every draw was the vocabulary's last token."""


@dataclass(frozen=True)
class Sampling:
    """``temperature`` > 0; ``top_k`` None or 0: no top-k; ``top_p`` None or 1: no top-p;
    ``seed`` None: a fresh random seed per request."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= MIN_TEMPERATURE):
            raise SamplingError(f"temperature must be a number >= {MIN_TEMPERATURE} (0 for greedy), "
                                f"got {self.temperature!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 0):
            raise SamplingError(f"top_k must be a whole number >= 0, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @classmethod
    def of(cls, temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
           seed: int | None = None) -> Sampling | None:
        """The settings for these options, or None for greedy decoding (temperature 0 or
        not given; top-k / top-p alone do not turn sampling on, as in ``do_sample=False``)."""
        if temperature is None or temperature == 0:
            return None
        return cls(float(temperature), top_k, top_p, seed)

    def processors(self) -> LogitsProcessorList:
        """transformers' warpers, in the order ``generate(do_sample=True)`` applies them."""
        processors = LogitsProcessorList()
        if self.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            processors.append(TopKLogitsWarper(top_k=self.top_k, min_tokens_to_keep=1))
        if self.top_p is not None and self.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=self.top_p, min_tokens_to_keep=1))
        return processors


class Sampler:
    """One request's draws.

    The draw for output position i (0: the prefill's token) uses the i-th of a seeded stream of
    uniforms, through the inverse CDF of the processed distribution there. So the text a seed
    gives is a function of the seed and the target alone: drafting changes which positions one
    forward pass covers, never a token (every method, `ar` included, gives the same output for
    the same seed), and each token is still an exact draw from the target's conditional.
    """

    def __init__(self, sampling: Sampling, max_tokens: int):
        self.sampling = sampling
        self.processors = sampling.processors()
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        self.uniforms = np.random.default_rng(seed).random(max_tokens + 1)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed distribution at each row of ``logits`` (rows, vocab), float64."""
        scores = self.processors(None, logits.double())
        return torch.softmax(scores, dim=-1)

    def token(self, logits_row: torch.Tensor, position: int) -> int:
        """The draw for output position ``position`` from one row of logits."""
        return self.token_at(logits_row, float(self.uniforms[min(position, len(self.uniforms) - 1)]))

    def token_at(self, logits_row: torch.Tensor, uniform: float) -> int:
        """The token whose processed-CDF interval holds ``uniform`` (in [0, 1))."""
        probs = self.probabilities(logits_row[None])[0]
        cdf = torch.cumsum(probs, 0)
        u = uniform * float(cdf[-1])
        index = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype, device=cdf.device), right=True)[0])
        index = min(index, probs.shape[0] - 1)
        while probs[index] == 0:  # u at the very top of the CDF: the last token that can be drawn
            index -= 1
        return index
