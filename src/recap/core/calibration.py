"""Online calibration: raw draft scores -> probabilities of acceptance, learned in the stream.

A draft node's raw score (the fused row probability q at its depth, or a continuation's
match length and offset) ranks nodes but is not a probability. Every verification labels each
drafted node whose parent was accepted: accepted or not. Nodes are grouped into cells by
source and binned raw features. Each node has its own prior, a conservative guess from its
raw score, and its estimate is that prior times its cell's ratio of accepted nodes to the
sum of their own priors (smoothed by `prior_strength` pseudo-nodes at the cell's prior), so
the estimate starts cautious and follows the stream's outcomes (no training, nothing shared
between streams). The ratio divides by what the labelled nodes' *own* priors expected, not
by their count times the prior at the cell's midpoint: the chooser drafts the nodes it rates
highest, which sit near the top of their bin (0.8 q^1.5 varies 2.8x across the bin 0.1-0.2),
so dividing by the midpoint's prior read their higher raw scores as the cell doing better
than its prior and over-rated every node of the cell (docs/methods.md, "Calibration by
expected acceptances").

Sources and cells:
- ``RECYCLED``: 10 bins of q x depth buckets (1, 2, 3, 4-5, 6+); prior 0.8 q^1.5.
- ``REQUEST`` / ``STORE``: suffix continuations from the request's own text or from the
  stream's earlier outputs. A chain token's evidence is the number of matched tokens it
  follows if every chain token before it is accepted: the match length for the first, plus
  one per earlier chain token. Cells: evidence buckets x (first token | later token). The
  prior is the larger of a table by match length (`CONTINUATION_PRIOR`, a little higher
  after the first token) and the rule of succession, e / (e + `RUN_PSEUDO`): a copy that
  has run e tokens keeps running. Within a cell that smooth prior is kept (scaled
  by the cell's observed/expected ratio, as q is for recycled nodes), so a long copy's tokens
  are trusted more the further it has run, and one rejection at some offset does not freeze
  later offsets that were never tried again (cells keyed by offset did that).
- Opening chains: a continuation drafted at the request's first step rests on the prompt
  alone. A long match there is mostly the chat template (the user turn's end and the
  assistant header) plus the answer's first token, so whether the chain holds says whether
  this stream's answers repeat earlier ones, not how long the match is: opening chains have
  cells of their own (the same buckets), and their later tokens' prior is at least
  `OPENING_PRIOR` from 5 matched tokens on. (Sharing the running cells past 16 matched
  tokens was tried: tau on MMSpec fell, 2.72 -> 2.67.)

The priors' shapes were read off a held-out measurement (SmolLM2-135M on MMSpec items 3-6 of
each topic, never the bench's first two; every candidate drafted so every outcome was seen;
docs/methods.md): the recycled rate was close to q^1.3, a continuation after a match of 1
token was accepted about a fifth of the time and after 5+ tokens nine times in ten. The
recycled prior sits a little below that (0.8 q^1.5), because the chooser drafts the nodes it
rates highest, whose estimates are the likeliest to be too high; for continuations the rule
of succession's optimism measured better (`RUN_PSEUDO`).

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
EVIDENCE_EDGES = np.array([2, 3, 5, 9, 17, 33, 65])
"""Evidence (matched tokens) buckets: 1 | 2 | 3-4 | 5-8 | 9-16 | 17-32 | 33-64 | 65+."""
RELIABILITY_BINS = 10

_N_RECYCLED = Q_BINS * (len(DEPTH_EDGES) + 1)
_N_EVIDENCE = len(EVIDENCE_EDGES) + 1
_N_RUNNING = 2 * _N_EVIDENCE
"""Per continuation source: evidence buckets x (first | later)."""
_N_CONTINUATION = 2 * _N_RUNNING
"""Per continuation source: the running cells, then the opening ones."""
LEGACY_CELLS = _N_RECYCLED + 2 * 49
"""Cell count of calibrations saved before the evidence cells (match length x offset
buckets): their recycled counts still apply, their continuation counts are dropped."""
EVIDENCE_CELLS = _N_RECYCLED + 2 * _N_RUNNING
"""Cell count of calibrations saved before the opening cells: their recycled counts and
their continuation counts (as running ones) still apply; opening cells start from the prior."""

CONTINUATION_PRIOR = np.array([0.15, 0.3, 0.5, 0.75, 0.85, 0.85, 0.85, 0.85])
"""Prior acceptance of a continuation's first token by evidence bucket (later tokens, given
their parent accepted: +0.1, at most 0.9); long evidence rises past it (`run_prior`)."""
RUN_PSEUDO = 2.0
"""Rule-of-succession pseudo-count: after e matched tokens the next is accepted with prior
e / (e + 2) (0.89 at 17, 0.94 at 33, 0.97 at 65) wherever that beats the table. It also
lifts short matches' first tokens (1/3 after 1 token where the table says 0.15): tried both
ways with the cost profile fixed, the lift drafted more and gained tau on MMSpec (2.58 ->
2.69) and on the repeats set (8.68 -> 8.98), the calibration pulling the cells back within
a few outcomes where the matches were coincidences."""
CONTINUATION_CAP = 0.995
OPENING_PRIOR = 0.98
"""Prior acceptance of an opening chain's later tokens after 5+ matched tokens (its first
token accepted: the answer copies an earlier one). Measured with the cost profile fixed
(SmolLM2; docs/methods.md): 0.98-1.0 at every evidence on the stress set, 3 of 4 on MMSpec's
multi-turn units. With the running prior (0.9 up to 16 matched tokens) a stream's first
repeated answer was drafted 6 tokens at a time where SAM drafted it whole."""


def recycled_prior(q: np.ndarray) -> np.ndarray:
    """Prior acceptance of a recycled node with fused probability q: 0.8 q^1.5, below q
    (fused rows are over-confident, most of all when flat)."""
    return 0.8 * np.power(q, 1.5)


def recycled_cells(q: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Cell index of recycled nodes with fused probability ``q`` at ``depth``."""
    q_bin = np.minimum((np.asarray(q, dtype=np.float64) * Q_BINS).astype(np.int64), Q_BINS - 1)
    return np.searchsorted(DEPTH_EDGES, depth, side="right") * Q_BINS + q_bin


def is_recycled(cells: np.ndarray) -> np.ndarray:
    """Which cell indices are recycled-node cells (-1, no cell: False)."""
    cells = np.asarray(cells)
    return (cells >= 0) & (cells < _N_RECYCLED)


def evidence(match_length: int, offsets: np.ndarray) -> np.ndarray:
    """Matched tokens behind each chain token (offsets 1, 2, ...), if all before it are accepted."""
    return match_length + np.asarray(offsets, dtype=np.int64) - 1


def continuation_cells(source: int, match_length: int, offsets: np.ndarray, opening: bool = False) -> np.ndarray:
    """Cell indices of a continuation chain's tokens (offsets 1, 2, ...) under one match;
    ``opening``: drafted at the request's first step (cells of their own)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    bucket = np.searchsorted(EVIDENCE_EDGES, evidence(match_length, offsets), side="right")
    base = _N_RECYCLED + (source - REQUEST) * _N_CONTINUATION + (_N_RUNNING if opening else 0)
    return base + 2 * bucket + (offsets > 1)


def run_prior(evidence: np.ndarray, later: np.ndarray, opening: bool = False) -> np.ndarray:
    """Prior acceptance of continuation tokens with this evidence (first or later token):
    the bucket table, or the rule of succession where that is higher; for an opening
    chain's later tokens after 5+ matched tokens, at least `OPENING_PRIOR`."""
    evidence = np.asarray(evidence, dtype=np.float64)
    bucket = np.searchsorted(EVIDENCE_EDGES, evidence, side="right")
    table = np.minimum(CONTINUATION_PRIOR[bucket] + np.where(later, 0.1, 0.0), 0.9)
    prior = np.maximum(table, evidence / (evidence + RUN_PSEUDO))
    if opening:
        prior = np.where(later & (evidence >= 5), np.maximum(prior, OPENING_PRIOR), prior)
    return prior


def _with_opening_cells(counts: np.ndarray) -> np.ndarray:
    """Counts of the `EVIDENCE_CELLS` layout in today's: each source's cells become its
    running ones, its opening ones start empty."""
    out = np.zeros(_N_RECYCLED + 2 * _N_CONTINUATION)
    out[:_N_RECYCLED] = counts[:_N_RECYCLED]
    for source in range(2):
        old = _N_RECYCLED + source * _N_RUNNING
        new = _N_RECYCLED + source * _N_CONTINUATION
        out[new:new + _N_RUNNING] = counts[old:old + _N_RUNNING]
    return out


class AcceptanceCalibrator:
    """Beta-binomial estimate of P(accepted | parent accepted) per cell (see module doc)."""

    def __init__(self, *, prior_strength: float = 2.0, enabled: bool = True):
        self.prior_strength = prior_strength
        self.enabled = enabled
        """False: estimates are the prior means, never updated (the no-calibration ablation)."""
        n_cells = _N_RECYCLED + 2 * _N_CONTINUATION
        self.trials = np.zeros(n_cells, dtype=np.float64)
        self.accepts = np.zeros(n_cells, dtype=np.float64)
        self.expected = np.zeros(n_cells, dtype=np.float64)
        """Per cell, the sum of its labelled nodes' own priors (what the prior expected)."""
        self.prior = np.empty(n_cells, dtype=np.float64)
        q_mid = (np.arange(Q_BINS) + 0.5) / Q_BINS
        self.prior[:_N_RECYCLED] = np.tile(recycled_prior(q_mid), len(DEPTH_EDGES) + 1)
        # A cell's prior is the smooth prior at its bucket's lowest evidence (the 65+ bucket at 65).
        lowest = np.concatenate([[1], EVIDENCE_EDGES])
        phases = [np.stack([run_prior(lowest, False, opening), run_prior(lowest, True, opening)], axis=1).reshape(-1)
                  for opening in (False, True)]
        self.prior[_N_RECYCLED:] = np.tile(np.concatenate(phases), 2)  # both sources
        self._ratio = np.ones(n_cells, dtype=np.float64)
        """Per cell, observed / expected acceptance (smoothed): what scales a node's own prior."""
        self.reliability_counts = np.zeros(RELIABILITY_BINS, dtype=np.float64)
        self.reliability_predicted = np.zeros(RELIABILITY_BINS, dtype=np.float64)
        self.reliability_observed = np.zeros(RELIABILITY_BINS, dtype=np.float64)

    def reset(self) -> None:
        """Forget every outcome (a new stream starts)."""
        self.__init__(prior_strength=self.prior_strength, enabled=self.enabled)

    def restore(self, trials: np.ndarray, accepts: np.ndarray, expected: np.ndarray | None = None) -> None:
        """Continue from saved counts (`trials`, `accepts`, `expected` of another stream's
        calibrator; without ``expected``, as files before it: each trial at its cell's prior)."""
        trials = np.asarray(trials, dtype=np.float64)
        accepts = np.asarray(accepts, dtype=np.float64)
        if trials.shape == accepts.shape == (LEGACY_CELLS,):  # recycled counts carry over
            trials = np.concatenate([trials[:_N_RECYCLED], np.zeros(2 * _N_CONTINUATION)])
            accepts = np.concatenate([accepts[:_N_RECYCLED], np.zeros(2 * _N_CONTINUATION)])
            expected = None  # older layouts were saved without it
        elif trials.shape == accepts.shape == (EVIDENCE_CELLS,):  # + continuation counts, as running
            trials, accepts = (_with_opening_cells(counts) for counts in (trials, accepts))
            expected = None
        if trials.shape != self.trials.shape or accepts.shape != self.accepts.shape:
            raise ValueError(f"calibration counts for {trials.shape[0]} cells; this RECAP has {self.trials.shape[0]}")
        expected = trials * self.prior if expected is None else np.asarray(expected, dtype=np.float64)
        if expected.shape != trials.shape:
            raise ValueError(f"expected counts for {expected.shape[0]} cells; this RECAP has {trials.shape[0]}")
        self.trials = trials.copy()
        self.accepts = accepts.copy()
        self.expected = expected.copy()
        if self.enabled:
            self._recompute_ratios()

    # ----------------------------------------------------------------- estimates
    def estimate(self, cells: np.ndarray) -> np.ndarray:
        """P(accepted | parent accepted) for nodes in ``cells``."""
        return self.prior[cells] * self._ratio[cells]

    def continuation(self, source: int, match_length: int, offsets: np.ndarray,
                     opening: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(estimates, cells, priors) of a chain's tokens: the smooth prior of each token's
        evidence, scaled by its cell's observed/expected ratio, at most `CONTINUATION_CAP`;
        ``opening``: the chain is drafted at the request's first step (see the module doc)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        cells = continuation_cells(source, match_length, offsets, opening)
        prior = run_prior(evidence(match_length, offsets), offsets > 1, opening)
        if not self.enabled:
            return prior, cells, prior
        return np.minimum(prior * self._ratio[cells], CONTINUATION_CAP), cells, prior

    def recycled(self, q: np.ndarray, depth: np.ndarray) -> np.ndarray:
        """Estimates for recycled nodes; within a cell the prior's q dependence is kept, so
        nodes of one bin still rank by q (scaled by the cell's observed/expected ratio)."""
        q = np.asarray(q, dtype=np.float64)
        prior = recycled_prior(q)
        if not self.enabled:
            return prior
        cells = recycled_cells(q, depth)
        return np.minimum(prior * self._ratio[cells], 0.999)

    # ----------------------------------------------------------------- learning
    def update(self, cells: np.ndarray, accepted: np.ndarray, priors: np.ndarray | None = None) -> None:
        """One verification's labels: the cells of nodes whose parent was accepted, whether
        each was accepted and each node's own prior there (None or NaN: the cell's). A node
        offered by two sources labels both cells."""
        if not self.enabled or not len(cells):
            return
        cells = np.asarray(cells, dtype=np.int64)
        own = self.prior[cells]
        if priors is not None:
            priors = np.asarray(priors, dtype=np.float64)
            own = np.where(np.isnan(priors), own, priors)
        n_cells = len(self.trials)
        self.trials += np.bincount(cells, minlength=n_cells)
        self.accepts += np.bincount(cells, np.asarray(accepted, dtype=np.float64), minlength=n_cells)
        self.expected += np.bincount(cells, own, minlength=n_cells)
        self._recompute_ratios()

    def _recompute_ratios(self) -> None:
        """Every cell's ratio from its counts (a few hundred cells: whole-array arithmetic is
        cheaper than picking the touched ones)."""
        pseudo = self.prior_strength * self.prior
        np.divide(self.accepts + pseudo, self.expected + pseudo, out=self._ratio)

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
