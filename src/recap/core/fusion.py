"""Entropy-confidence-weighted fusion of the rows retrieved for one history.

Rows arrive most specific first (G, C, U, whichever exist). Row j gets the prior of its rank
among the *available* rows (0.70, 0.20, 0.10) times its confidence exp(-H(P_j)); weights are
normalised, the mixture m = sum_j w_j P_j is cut to its K largest entries and renormalised.
Ablation modes replace one ingredient at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter

from recap.core.memory import Row

PRIORS = (0.70, 0.20, 0.10)
FUSION_MODES = ("entropy", "no-confidence", "no-prior", "uniform", "gate", "backoff", "unigram")
"""``entropy`` is RECAP. ``no-confidence``: c_j = 1. ``no-prior``: alpha_j = 1. ``uniform``:
both. ``gate``: the most confident row alone (ties: the more specific). ``backoff``: the most
specific row alone. ``unigram``: U alone (the caller retrieves only U)."""


def _top(tokens: Sequence[int], probs: Sequence[float], k: int) -> tuple[Sequence[int], Sequence[float]]:
    if len(tokens) <= k:
        return tokens, probs  # stored rows are already normalised
    total = sum(probs[:k])
    return tokens[:k], [p / total for p in probs[:k]]


def fuse(rows: Sequence[Row], k: int = 8, mode: str = "entropy",
         priors: Sequence[float] = PRIORS) -> tuple[Sequence[int], Sequence[float]]:
    """Fused proposal q(. | h): up to ``k`` tokens with probabilities, highest first.
    No rows -> empty (expansion ends at this node)."""
    if not rows:
        return (), ()
    if len(rows) == 1 or mode in ("backoff", "unigram"):
        return _top(rows[0][0], rows[0][1], k)
    if mode == "gate":
        best = max(range(len(rows)), key=lambda j: (rows[j][2], -j))
        return _top(rows[best][0], rows[best][1], k)
    use_prior = mode in ("entropy", "no-confidence")
    use_confidence = mode in ("entropy", "no-prior")
    weights = [(priors[j] if use_prior else 1.0) * (row[2] if use_confidence else 1.0) for j, row in enumerate(rows)]
    norm = sum(weights)
    mixture: dict[int, float] = {}
    get = mixture.get
    for weight, (ids, probs, _) in zip(weights, rows):
        w = weight / norm
        for token, p in zip(ids, probs):
            mixture[token] = get(token, 0.0) + w * p
    # Stable sort: equal masses keep first-seen order, i.e. the more specific row's order.
    ranked = sorted(mixture.items(), key=itemgetter(1), reverse=True)[:k]
    total = sum(p for _, p in ranked)
    return [t for t, _ in ranked], [p / total for _, p in ranked]
