"""Online calibration: raw draft scores -> probabilities of acceptance, learned in the stream.

A draft node's raw score (the fused row probability q at its depth, or a continuation's
match length and offset) ranks nodes but is not a probability. Every verification labels each
drafted node whose parent was accepted: accepted or not. Nodes are grouped into cells by
source and binned raw features; each cell keeps a Beta posterior whose prior is a
conservative guess from the raw score, so the estimate starts cautious and follows the
stream's outcomes (no training, nothing shared between streams).

Sources and cells:
- ``RECYCLED``: 10 bins of q x depth buckets (1, 2, 3, 4-5, 6+); prior mean 0.8 q^1.5.
- ``REQUEST`` / ``STORE``: suffix continuations from the request's own text or from the
  stream's earlier outputs, match-length buckets x offset buckets; prior mean rising with the
  match length (`CONTINUATION_PRIOR`), a little higher after the first token.

The priors' shapes were read off a held-out measurement (SmolLM2-135M on MMSpec items 3-6 of
each topic, never the bench's first two; every candidate drafted so every outcome was seen;
docs/methods.md): the recycled rate was close to q^1.3, a continuation after a match of 1
token was accepted about a fifth of the time and after 5+ tokens nine times in ten. The
priors sit a little below that (0.8 q^1.5; 0.15 after a 1-token match), because the chooser
drafts the nodes it rates highest, whose estimates are the likeliest to be too high.

A reliability table (predicted vs observed acceptance per bin of the prediction) and the
expected calibration error are kept for reports.
"""

from __future__ import annotations

import numpy as np

RECYCLED, REQUEST, STORE = 0, 1, 2
SOURCE_NAMES = ("recycled", "request", "store")

Q_BINS = 10
DEPTH_EDGES = np.array([2, 3, 4, 6])
"""Depth buckets: 1 | 2 | 3 | 4-5 | 6+ (``searchsorted(edges, depth, 'right')``)."""
LENGTH_EDGES = np.array([2, 3, 5, 9, 17, 33])
"""Match-length buckets: 1 | 2 | 3-4 | 5-8 | 9-16 | 17-32 | 33+."""
OFFSET_EDGES = np.array([2, 3, 5, 9, 17, 33])
"""Offset (1 = first continuation token) buckets, same edges."""
RELIABILITY_BINS = 10

_N_RECYCLED = Q_BINS * (len(DEPTH_EDGES) + 1)
_N_CONTINUATION = (len(LENGTH_EDGES) + 1) * (len(OFFSET_EDGES) + 1)


CONTINUATION_PRIOR = np.array([0.15, 0.3, 0.5, 0.75, 0.85, 0.85, 0.85])
"""Prior acceptance of a continuation's first token by match-length bucket (later tokens,
given their parent accepted: +0.1, at most 0.9)."""


def recycled_prior(q: np.ndarray) -> np.ndarray:
    """Prior acceptance of a recycled node with fused probability q: 0.8 q^1.5, below q
    (fused rows are over-confident, most of all when flat)."""
    return 0.8 * np.power(q, 1.5)


def recycled_cells(q: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Cell index of recycled nodes with fused probability ``q`` at ``depth``."""
    q_bin = np.minimum((np.asarray(q, dtype=np.float64) * Q_BINS).astype(np.int64), Q_BINS - 1)
    return np.searchsorted(DEPTH_EDGES, depth, side="right") * Q_BINS + q_bin


def continuation_cells(source: int, match_length: int, offsets: np.ndarray) -> np.ndarray:
    """Cell indices of a continuation chain's tokens (offsets 1, 2, ...) under one match."""
    length_bin = int(np.searchsorted(LENGTH_EDGES, match_length, side="right"))
    offset_bin = np.searchsorted(OFFSET_EDGES, offsets, side="right")
    base = _N_RECYCLED + (source - REQUEST) * _N_CONTINUATION
    return base + length_bin * (len(OFFSET_EDGES) + 1) + offset_bin


class AcceptanceCalibrator:
    """Beta-binomial estimate of P(accepted | parent accepted) per cell (see module doc)."""

    def __init__(self, *, prior_strength: float = 2.0, enabled: bool = True):
        self.prior_strength = prior_strength
        self.enabled = enabled
        """False: estimates are the prior means, never updated (the no-calibration ablation)."""
        n_cells = _N_RECYCLED + 2 * _N_CONTINUATION
        self.trials = np.zeros(n_cells, dtype=np.float64)
        self.accepts = np.zeros(n_cells, dtype=np.float64)
        self.prior = np.empty(n_cells, dtype=np.float64)
        q_mid = (np.arange(Q_BINS) + 0.5) / Q_BINS
        self.prior[:_N_RECYCLED] = np.tile(recycled_prior(q_mid), len(DEPTH_EDGES) + 1)
        grid = CONTINUATION_PRIOR[:, None] + np.where(np.arange(len(OFFSET_EDGES) + 1) > 0, 0.1, 0.0)[None, :]
        grid = np.minimum(grid, 0.9).reshape(-1)
        self.prior[_N_RECYCLED:_N_RECYCLED + _N_CONTINUATION] = grid
        self.prior[_N_RECYCLED + _N_CONTINUATION:] = grid
        self._estimate = self.prior.copy()
        self.reliability_counts = np.zeros(RELIABILITY_BINS, dtype=np.float64)
        self.reliability_predicted = np.zeros(RELIABILITY_BINS, dtype=np.float64)
        self.reliability_observed = np.zeros(RELIABILITY_BINS, dtype=np.float64)

    def reset(self) -> None:
        """Forget every outcome (a new stream starts)."""
        self.__init__(prior_strength=self.prior_strength, enabled=self.enabled)

    def restore(self, trials: np.ndarray, accepts: np.ndarray) -> None:
        """Continue from saved counts (`trials`, `accepts` of another stream's calibrator)."""
        trials = np.asarray(trials, dtype=np.float64)
        accepts = np.asarray(accepts, dtype=np.float64)
        if trials.shape != self.trials.shape or accepts.shape != self.accepts.shape:
            raise ValueError(f"calibration counts for {trials.shape[0]} cells; this RECAP has {self.trials.shape[0]}")
        self.trials = trials.copy()
        self.accepts = accepts.copy()
        if self.enabled:
            strength = self.prior_strength
            self._estimate = (self.accepts + strength * self.prior) / (self.trials + strength)

    # ----------------------------------------------------------------- estimates
    def estimate(self, cells: np.ndarray) -> np.ndarray:
        """P(accepted | parent accepted) for nodes in ``cells``."""
        return self._estimate[cells]

    def recycled(self, q: np.ndarray, depth: np.ndarray) -> np.ndarray:
        """Estimates for recycled nodes; within a cell the prior's q dependence is kept, so
        nodes of one bin still rank by q (scaled by the cell's observed/prior ratio)."""
        q = np.asarray(q, dtype=np.float64)
        prior = recycled_prior(q)
        if not self.enabled:
            return prior
        cells = recycled_cells(q, depth)
        return np.minimum(prior * (self._estimate[cells] / self.prior[cells]), 0.999)

    # ----------------------------------------------------------------- learning
    def update(self, cells: np.ndarray, accepted: np.ndarray) -> None:
        """One verification's labels: the cells of nodes whose parent was accepted, and
        whether each was accepted. A node offered by two sources labels both cells."""
        if not self.enabled or not len(cells):
            return
        cells = np.asarray(cells, dtype=np.int64)
        np.add.at(self.trials, cells, 1.0)
        np.add.at(self.accepts, cells, np.asarray(accepted, dtype=np.float64))
        touched = np.unique(cells)
        strength = self.prior_strength
        self._estimate[touched] = (self.accepts[touched] + strength * self.prior[touched]) \
            / (self.trials[touched] + strength)

    def record(self, predicted: np.ndarray, accepted: np.ndarray) -> None:
        """Add labelled nodes (their final predicted probability, accepted or not) to the
        reliability table."""
        if not len(predicted):
            return
        predicted = np.asarray(predicted, dtype=np.float64)
        bins = np.minimum((predicted * RELIABILITY_BINS).astype(np.int64), RELIABILITY_BINS - 1)
        np.add.at(self.reliability_counts, bins, 1.0)
        np.add.at(self.reliability_predicted, bins, predicted)
        np.add.at(self.reliability_observed, bins, np.asarray(accepted, dtype=np.float64))

    # ----------------------------------------------------------------- reports
    def reliability(self) -> dict:
        """Per bin of the prediction: count, mean predicted, observed acceptance rate; and the
        expected calibration error (count-weighted mean |predicted - observed|)."""
        counts = self.reliability_counts
        rows = []
        for b in range(RELIABILITY_BINS):
            n = counts[b]
            if n:
                rows.append({"bin": f"{b / RELIABILITY_BINS:.1f}-{(b + 1) / RELIABILITY_BINS:.1f}", "count": int(n),
                             "predicted": float(self.reliability_predicted[b] / n),
                             "observed": float(self.reliability_observed[b] / n)})
        total = counts.sum()
        ece = float(sum(r["count"] * abs(r["predicted"] - r["observed"]) for r in rows) / total) if total else None
        return {"bins": rows, "ece": ece, "labels": int(total)}

    def reliability_state(self) -> dict:
        """Raw sums, so several streams' tables can be added up (`combine_reliability`)."""
        return {"counts": self.reliability_counts.tolist(), "predicted": self.reliability_predicted.tolist(),
                "observed": self.reliability_observed.tolist()}


def combine_reliability(states: list[dict]) -> dict:
    """One reliability table (as `AcceptanceCalibrator.reliability`) from several raw states."""
    calibrator = AcceptanceCalibrator()
    for state in states:
        calibrator.reliability_counts += np.asarray(state["counts"], dtype=np.float64)
        calibrator.reliability_predicted += np.asarray(state["predicted"], dtype=np.float64)
        calibrator.reliability_observed += np.asarray(state["observed"], dtype=np.float64)
    return calibrator.reliability()
