"""Is sampling with drafts distributed exactly like plain sampling? A statistical check.

For a prompt, the exact distribution of the first ``depth`` generated tokens is computed from
the target itself (plain forwards over every prefix, no cache, no trees): the most likely
prefixes explicitly, the rest as one "other" cell. Then ``runs`` seeded generations with the
method under test (one stream, so its memory learns as it goes) are counted into the same
cells and compared with a chi-square goodness-of-fit test, jointly and per position. With
top-k 4 and depth 3 every prefix is a cell (the tests' setting); on a real vocabulary the
cells cover the likeliest prefixes. The check also reports how many draft tokens were
accepted: a pass with no drafting would prove nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from recap.decoding import decode
from recap.proposers import Proposer
from recap.verifier import ModelInputs, TargetModel
from recap.verifier.sampling import Sampler, Sampling

OTHER = ("other",)
MIN_EXPECTED = 5.0


@dataclass
class SamplingCheck:
    """One prompt's result: p-values of the joint and per-position tests."""

    p_joint: float
    p_positions: list[float]
    runs: int
    cells: int
    accepted: int
    """Draft tokens accepted over all runs."""
    alpha: float = 0.001
    counts: dict = field(default_factory=dict, repr=False)

    @property
    def passed(self) -> bool:
        return self.p_joint >= self.alpha and all(p >= self.alpha for p in self.p_positions)


@torch.inference_mode()
def exact_prefixes(target: TargetModel, inputs: ModelInputs, sampling: Sampling, depth: int, *,
                   max_branch: int = 16, mass: float = 0.999) -> dict[tuple, float]:
    """P(first generated tokens = prefix) for the likeliest prefixes (each node expands its
    likeliest tokens until ``mass`` of it is covered, at most ``max_branch``), prefixes ending
    at EOS kept short; everything else under `OTHER`."""
    sampler = Sampler(sampling, 1)
    eos = set(target.eos_token_ids)
    prompt = inputs.input_ids.to(target.device)
    extra = {k: v.to(target.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.extra.items()}
    extra.pop("attention_mask", None)
    probabilities: dict[tuple, float] = {}
    frontier: list[tuple[tuple, float]] = [((), 1.0)]
    for level in range(depth):
        grown = []
        for prefix, p in frontier:
            ids = torch.cat([prompt, torch.tensor([prefix], dtype=prompt.dtype, device=prompt.device)], dim=1) \
                if prefix else prompt
            out = target.model(input_ids=ids, attention_mask=torch.ones_like(ids), **_extended(extra, prompt, ids))
            probs = sampler.probabilities(out.logits[0, -1:])[0]
            values, tokens = torch.sort(probs, descending=True)
            covered = 0.0
            for value, token in zip(values.tolist()[:max_branch], tokens.tolist()[:max_branch]):
                if value <= 0 or covered >= mass:
                    break
                covered += value
                child = (*prefix, int(token))
                if int(token) in eos or level == depth - 1:
                    probabilities[child] = p * value
                else:
                    grown.append((child, p * value))
        frontier = grown
    probabilities[OTHER] = max(0.0, 1.0 - sum(probabilities.values()))
    return probabilities


def _extended(extra: dict, prompt: torch.Tensor, ids: torch.Tensor) -> dict:
    """Per-token model inputs (e.g. Qwen's ``mm_token_type_ids``) padded with zeros (text)
    to the longer sequence."""
    grown = ids.shape[1] - prompt.shape[1]
    out = dict(extra)
    for key, value in extra.items():
        if grown and isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == prompt.shape:
            out[key] = torch.cat([value, value.new_zeros((1, grown))], dim=1)
    return out


def _cell(tokens: list[int], probabilities: dict[tuple, float], eos: set[int], depth: int) -> tuple:
    prefix = []
    for token in tokens[:depth]:
        prefix.append(int(token))
        if token in eos:
            break
    prefix = tuple(prefix)
    return prefix if prefix in probabilities else OTHER


def chi_square_p(counts: Counter, probabilities: dict, runs: int) -> tuple[float, int]:
    """Goodness-of-fit p-value (and cells used) after pooling cells expected below 5."""
    observed, expected, pooled_o, pooled_e = [], [], 0.0, 0.0
    for cell, p in probabilities.items():
        if p * runs >= MIN_EXPECTED:
            observed.append(counts.get(cell, 0))
            expected.append(p * runs)
        else:
            pooled_o += counts.get(cell, 0)
            pooled_e += p * runs
    if pooled_e > 0 or pooled_o > 0:
        observed.append(pooled_o)
        expected.append(max(pooled_e, 1e-9))
    if len(observed) < 2:
        return 1.0, len(observed)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(observed) - 1
    p = 1.0 - float(torch.distributions.Chi2(torch.tensor(float(df))).cdf(torch.tensor(float(stat))))
    return p, len(observed)


def _marginals(probabilities: dict[tuple, float], position: int) -> dict[tuple, float]:
    marginal: dict[tuple, float] = {}
    for prefix, p in probabilities.items():
        key = OTHER if prefix == OTHER or len(prefix) <= position else (prefix[position],)
        marginal[key] = marginal.get(key, 0.0) + p
    return marginal


def check_sampling(target: TargetModel, proposer: Proposer, inputs: ModelInputs, sampling: Sampling, *,
                   depth: int = 3, runs: int = 1000, first_seed: int = 0, alpha: float = 0.001,
                   probabilities: dict[tuple, float] | None = None,
                   on_run: Callable[[], None] | None = None) -> SamplingCheck:
    """Sample ``runs`` times (seeds ``first_seed`` ...) with ``proposer`` as one stream and
    test the first ``depth`` tokens against the exact distribution."""
    probabilities = probabilities if probabilities is not None else exact_prefixes(target, inputs, sampling, depth)
    eos = set(target.eos_token_ids)
    counts: Counter = Counter()
    accepted = 0
    for run in range(runs):
        seeded = Sampling(sampling.temperature, sampling.top_k, sampling.top_p, first_seed + run)
        result = decode(target, proposer, inputs, max_new_tokens=depth, sampling=seeded)
        accepted += sum(it.accepted for it in result.iterations)
        counts[_cell(result.tokens, probabilities, eos, depth)] += 1
        if on_run is not None:
            on_run()
    p_joint, cells = chi_square_p(counts, probabilities, runs)
    p_positions = []
    for position in range(depth):
        marginal = _marginals(probabilities, position)
        marginal_counts: Counter = Counter()
        for prefix, n in counts.items():
            key = OTHER if prefix == OTHER or len(prefix) <= position else (prefix[position],)
            marginal_counts[key] += n
        p_positions.append(chi_square_p(marginal_counts, marginal, runs)[0])
    return SamplingCheck(p_joint=p_joint, p_positions=p_positions, runs=runs, cells=cells, accepted=accepted,
                         alpha=alpha, counts=dict(counts))
