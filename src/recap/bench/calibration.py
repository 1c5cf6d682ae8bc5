"""Calibration of cost-aware drafting in a bench run: reliability of the acceptance estimates.

A method whose proposer has a ``calibrator`` (`recap.core.calibration.AcceptanceCalibrator`:
RECAP and its ablations) labels drafted nodes as it verifies them. Per (unit, method) row the
runner stores what the unit added to the calibrator's reliability sums, and, for a proposer
with ``chosen_sizes``, the mean draft size it chose per step:

- ``"reliability": {"counts": [...], "predicted": [...], "observed": [...]}`` (raw sums per
  bin of the predicted probability, `AcceptanceCalibrator.reliability_state`), only when the
  unit labelled at least one node;
- ``"chosen_nodes_mean"``: mean drafted nodes per step the proposer chose during the unit,
  only when it chose at least once.

The summary adds the units' sums up per method (`combine_reliability`): a table of bins
(count, mean predicted, observed acceptance) and the expected calibration error. Rows
without these fields (other methods, runs recorded before them) simply add nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

RELIABILITY = "reliability"
CHOSEN_NODES = "chosen_nodes_mean"


def _size_totals(sizes) -> tuple[int, int] | None:
    """(steps, sum of sizes) so far: a bounded `ChosenSizes` keeps running totals, a plain
    list is counted."""
    if sizes is None:
        return None
    steps = getattr(sizes, "steps", None)
    if steps is None:
        return len(sizes), int(sum(sizes))
    return int(steps), int(sizes.total)


def snapshot(proposer) -> tuple[dict | None, tuple[int, int] | None]:
    """What to diff after a decode: the calibrator's reliability sums and the (steps, total)
    of the chosen draft sizes so far (None for a proposer without them). Untimed."""
    calibrator = getattr(proposer, "calibrator", None)
    state = calibrator.reliability_state() if calibrator is not None else None
    return state, _size_totals(getattr(proposer, "chosen_sizes", None))


def unit_fields(proposer, before: tuple[dict | None, tuple[int, int] | None]) -> dict:
    """The row fields of one unit: what the decode added since ``before`` (`snapshot`)."""
    fields: dict = {}
    state_before, sizes_before = before
    calibrator = getattr(proposer, "calibrator", None)
    if calibrator is not None and state_before is not None:
        after = calibrator.reliability_state()
        diff = {key: [a - b for a, b in zip(after[key], state_before[key])] for key in ("counts", "predicted",
                                                                                      "observed")}
        if any(count < 0 for count in diff["counts"]):  # the stream was reset during the decode
            diff = after
        if sum(diff["counts"]) > 0:
            fields[RELIABILITY] = {"counts": [int(round(c)) for c in diff["counts"]],
                                   "predicted": [round(p, 6) for p in diff["predicted"]],
                                   "observed": [int(round(o)) for o in diff["observed"]]}
    after = _size_totals(getattr(proposer, "chosen_sizes", None))
    if after is not None and sizes_before is not None:
        steps, total = after
        if steps >= sizes_before[0]:
            steps, total = steps - sizes_before[0], total - sizes_before[1]
        if steps:  # (fewer steps than before: the stream was reset during the decode)
            fields[CHOSEN_NODES] = total / steps
    return fields


def method_calibration(rows: Sequence[dict]) -> dict:
    """Summary fields of one method's rows: ``reliability`` (bins, ece, labels, units) when
    any row carries reliability sums, ``chosen_nodes_mean`` (mean over units) when any row
    carries it; an empty dict otherwise."""
    from recap.core.calibration import combine_reliability

    out: dict = {}
    states = [row[RELIABILITY] for row in rows if row.get(RELIABILITY)]
    if states:
        out[RELIABILITY] = {**combine_reliability(states), "units": len(states)}
    chosen = [row[CHOSEN_NODES] for row in rows if row.get(CHOSEN_NODES) is not None]
    chosen = [value for value in chosen if not math.isnan(value)]
    if chosen:
        out[CHOSEN_NODES] = sum(chosen) / len(chosen)
    return out
