"""Online acceptance calibration (`recap.core.calibration`): priors, convergence on synthetic
Bernoulli outcomes, the reliability table and its ECE, the disabled ablation, reset."""

from __future__ import annotations

import numpy as np
import pytest

from recap.core.calibration import (
    RECYCLED,
    REQUEST,
    STORE,
    AcceptanceCalibrator,
    combine_reliability,
    continuation_cells,
    recycled_cells,
)

Q_MIDS = (np.arange(10) + 0.5) / 10


def _cells() -> dict[str, np.ndarray]:
    """A few cells of every source."""
    return {
        "recycled": recycled_cells(np.array([0.05, 0.55, 0.95, 0.55]), np.array([1, 1, 3, 7])),
        # first | later, then later tokens of ever longer evidence: four cells each
        "request": continuation_cells(REQUEST, 6, np.array([1, 2, 5, 20])),
        "store": continuation_cells(STORE, 20, np.array([1, 2, 14, 60])),
    }


def test_cells_of_every_source_are_distinct_and_in_range():
    calibrator = AcceptanceCalibrator()
    n_cells = len(calibrator.prior)
    q = np.repeat(Q_MIDS, 5)
    depth = np.tile([1, 2, 3, 4, 6], 10)
    recycled = recycled_cells(q, depth)
    assert len(set(recycled.tolist())) == 50
    request = continuation_cells(REQUEST, 40, np.arange(1, 41))
    store = continuation_cells(STORE, 40, np.arange(1, 41))
    assert not set(recycled.tolist()) & set(request.tolist())
    assert not set(request.tolist()) & set(store.tolist())
    everything = np.concatenate([recycled, request, store, continuation_cells(STORE, 1000, np.array([1000]))])
    assert everything.min() >= 0 and everything.max() < n_cells
    # q = 1 falls into the last bin, not past it; depths 4 and 5 share a bucket.
    assert recycled_cells(np.array([1.0]), np.array([1]))[0] == recycled_cells(np.array([0.95]), np.array([1]))[0]
    assert recycled_cells(np.array([0.5]), np.array([4]))[0] == recycled_cells(np.array([0.5]), np.array([5]))[0]
    assert RECYCLED == 0 and {REQUEST, STORE} == {1, 2}


def test_prior_before_any_data():
    calibrator = AcceptanceCalibrator()
    everything = np.arange(len(calibrator.prior))
    assert calibrator.estimate(everything) == pytest.approx(calibrator.prior)
    assert np.all((calibrator.prior > 0) & (calibrator.prior < 1))
    # Recycled nodes: at a bin's midpoint the estimate is the cell's prior; a cautious prior
    # (never above q), rising with q at every depth.
    for depth in (1, 2, 3, 4, 6, 10):
        cells = recycled_cells(Q_MIDS, np.full(10, depth))
        assert calibrator.recycled(Q_MIDS, np.full(10, depth)) == pytest.approx(calibrator.estimate(cells))
        q = np.linspace(0.0, 1.0, 101)
        estimates = calibrator.recycled(q, np.full(101, depth))
        assert np.all(np.diff(estimates) >= 0) and np.all(estimates <= q + 1e-12) and estimates[-1] > 0
    # Continuations: a longer match is at least as trustworthy, and markedly more than a 1-token one.
    for source in (REQUEST, STORE):
        for offset in (1, 2, 5, 20):
            by_length = [calibrator.estimate(continuation_cells(source, length, np.array([offset])))[0]
                         for length in (1, 2, 3, 5, 9, 17, 40)]
            assert np.all(np.diff(by_length) >= 0) and by_length[0] < by_length[-1]
    assert calibrator.reliability() == {"bins": [], "ece": None, "labels": 0}


def test_estimates_converge_to_the_true_acceptance_rates():
    rng = np.random.default_rng(0)
    calibrator = AcceptanceCalibrator()
    cells = _cells()
    truth = {"recycled": np.array([0.1, 0.5, 0.9, 0.3]), "request": np.array([0.9, 0.8, 0.5, 0.1]),
             "store": np.array([0.95, 0.9, 0.9, 0.2])}
    for _ in range(3000):  # one verification labels one node of every cell
        for name, cell in cells.items():
            calibrator.update(cell, rng.random(len(cell)) < truth[name])
    for name, cell in cells.items():
        assert calibrator.estimate(cell) == pytest.approx(truth[name], abs=0.03), name
    # Recycled estimates follow the cell's rate (scaled within the bin by q): at the bin's
    # midpoint the estimate is the cell's own.
    q, depth = np.array([0.05, 0.55, 0.95, 0.55]), np.array([1, 1, 3, 7])
    assert calibrator.recycled(q, depth) == pytest.approx(np.minimum(truth["recycled"], 0.999), abs=0.03)
    assert calibrator.recycled(np.array([0.51]), np.array([1]))[0] < calibrator.recycled(np.array([0.59]),
                                                                                      np.array([1]))[0]
    # Cells never labelled keep their prior.
    untouched = recycled_cells(np.array([0.35]), np.array([2]))
    assert calibrator.estimate(untouched) == pytest.approx(calibrator.prior[untouched])


def test_a_cell_is_judged_by_what_its_nodes_own_priors_expected():
    """The chooser drafts the nodes it rates highest, which sit near the top of their q bin.
    Accepted exactly as often as their own prior says, they leave the cell's ratio at 1: a
    node's estimate stays its prior. Judged against the prior at the bin's midpoint instead,
    the same outcomes read as the cell doing 1.4x better than expected and every node of the
    bin is over-rated (what the counts-only calibration did, the second calibrator here)."""
    from recap.core.calibration import recycled_prior

    q, depth = np.array([0.19]), np.array([1])
    cell = recycled_cells(q, depth)
    own = recycled_prior(q)[0]  # 0.066; the bin's midpoint (q 0.15) has 0.046
    n = 20000
    accepted = np.arange(n) < round(own * n)
    by_own, by_cell = AcceptanceCalibrator(), AcceptanceCalibrator()
    by_own.update(np.repeat(cell, n), accepted, np.full(n, own))
    by_cell.update(np.repeat(cell, n), accepted)  # no priors given: each node at its cell's
    assert by_own.recycled(q, depth)[0] == pytest.approx(own, rel=0.01)
    assert by_own.expected[cell][0] == pytest.approx(n * own)
    assert by_cell.recycled(q, depth)[0] > 1.3 * own
    # A NaN prior is the cell's own (a node whose source gave none).
    nan = AcceptanceCalibrator()
    nan.update(np.repeat(cell, n), accepted, np.full(n, np.nan))
    assert nan.recycled(q, depth)[0] == pytest.approx(by_cell.recycled(q, depth)[0])


def test_a_node_labelled_for_two_sources_counts_in_both_cells():
    calibrator = AcceptanceCalibrator(prior_strength=1.0)
    a = continuation_cells(REQUEST, 3, np.array([1]))[0]
    b = continuation_cells(STORE, 3, np.array([1]))[0]
    for _ in range(50):
        calibrator.update(np.array([a, b]), np.array([True, True]))
    assert calibrator.trials[a] == calibrator.trials[b] == 50
    assert calibrator.estimate(np.array([a, b])) == pytest.approx([1.0, 1.0], abs=0.02)
    calibrator.update(np.array([], dtype=np.int64), np.array([], dtype=bool))  # nothing labelled: no-op
    assert calibrator.trials.sum() == 100


def test_estimates_stay_probabilities():
    calibrator = AcceptanceCalibrator()
    cell = recycled_cells(np.array([0.95]), np.array([1]))
    for _ in range(200):
        calibrator.update(cell, np.array([True]))
    assert 0.0 < calibrator.recycled(np.array([1.0]), np.array([1]))[0] <= 0.999
    for _ in range(2000):
        calibrator.update(cell, np.array([False]))
    assert 0.0 <= calibrator.recycled(np.array([0.95]), np.array([1]))[0] < 0.1


# ----------------------------------------------------------------------------- reliability
def test_ece_is_small_for_a_calibrated_predictor_and_large_for_a_bad_one():
    rng = np.random.default_rng(1)
    predicted = rng.random(20000)
    good = AcceptanceCalibrator()
    good.record(predicted, rng.random(20000) < predicted)
    report = good.reliability()
    assert report["labels"] == 20000
    assert report["ece"] < 0.02
    assert len(report["bins"]) == 10
    for row in report["bins"]:
        assert abs(row["predicted"] - row["observed"]) < 0.05
        lo, hi = (float(x) for x in row["bin"].split("-"))
        assert lo <= row["predicted"] <= hi
    assert sum(row["count"] for row in report["bins"]) == 20000

    bad = AcceptanceCalibrator()
    bad.record(np.full(5000, 0.9), rng.random(5000) < 0.1)  # confident and mostly wrong
    bad_report = bad.reliability()
    assert bad_report["ece"] == pytest.approx(0.8, abs=0.03)
    assert [row["bin"] for row in bad_report["bins"]] == ["0.9-1.0"]


def test_reliability_states_combine_across_streams():
    rng = np.random.default_rng(2)
    streams, together = [], AcceptanceCalibrator()
    for _ in range(3):
        predicted = rng.random(300)
        accepted = rng.random(300) < predicted ** 2
        calibrator = AcceptanceCalibrator()
        calibrator.record(predicted, accepted)
        together.record(predicted, accepted)
        streams.append(calibrator.reliability_state())
    combined = combine_reliability(streams)
    assert combined["labels"] == 900
    assert combined["ece"] == pytest.approx(together.reliability()["ece"])


# ----------------------------------------------------------------------------- ablation and reset
def test_a_disabled_calibrator_never_moves():
    calibrator = AcceptanceCalibrator(enabled=False)
    before = calibrator.estimate(np.arange(len(calibrator.prior))).copy()
    q, depth = np.array([0.15, 0.85]), np.array([1, 4])
    recycled_before = calibrator.recycled(q, depth).copy()
    rng = np.random.default_rng(3)
    for cell in _cells().values():
        for _ in range(100):
            calibrator.update(cell, rng.random(len(cell)) < 0.5)
    calibrator.update(recycled_cells(q, depth), np.array([False, False]))
    assert calibrator.estimate(np.arange(len(calibrator.prior))) == pytest.approx(before)
    assert calibrator.recycled(q, depth) == pytest.approx(recycled_before)
    assert calibrator.trials.sum() == 0
    # The same priors as an enabled calibrator that has seen nothing.
    assert AcceptanceCalibrator().recycled(q, depth) == pytest.approx(recycled_before)


def test_reset_forgets_outcomes_and_keeps_the_settings():
    calibrator = AcceptanceCalibrator(prior_strength=2.0)
    prior = calibrator.prior.copy()
    for cell in _cells().values():
        calibrator.update(cell, np.zeros(len(cell), dtype=bool))
    calibrator.record(np.array([0.2, 0.7]), np.array([True, False]))
    assert calibrator.trials.sum() > 0 and calibrator.reliability()["labels"] == 2
    assert not np.allclose(calibrator.estimate(np.arange(len(prior))), prior)
    calibrator.reset()
    assert calibrator.trials.sum() == 0 and calibrator.accepts.sum() == 0
    assert calibrator.estimate(np.arange(len(prior))) == pytest.approx(prior)
    assert calibrator.reliability()["labels"] == 0
    assert calibrator.prior_strength == 2.0 and calibrator.enabled
    disabled = AcceptanceCalibrator(enabled=False)
    disabled.reset()
    assert not disabled.enabled


# ----------------------------------------------------------------------------- long copies
def test_a_long_copy_is_trusted_more_the_further_it_has_run():
    calibrator = AcceptanceCalibrator()
    for source in (REQUEST, STORE):
        probs, _, _ = calibrator.continuation(source, 20, np.arange(1, 61))
        assert np.all(np.diff(probs[1:]) >= 0) and probs[-1] > 0.97  # evidence 21 .. 79
        # A 1-token match: the rule of succession's 1/3, above the measured table's 0.15.
        short, _, _ = calibrator.continuation(source, 1, np.array([1]))
        assert short[0] == pytest.approx(1 / 3)
    # The chooser multiplies these along the chain: before any outcome, 40 tokens after a
    # 20-token match keep 21 x 22 / (60 x 61) = 12.6% of their path probability (the old
    # cap of 0.9 per token kept 0.9^39 = 1.6%); outcomes raise it from there.
    probs, _, _ = calibrator.continuation(REQUEST, 20, np.arange(1, 41))
    assert np.prod(probs[1:]) == pytest.approx(21 * 22 / (60 * 61))


def test_one_rejection_does_not_freeze_the_offsets_never_tried_again():
    """Cells keyed by evidence: a copy rejected at its 4th token once, then accepted 3 tokens
    a step for many steps, trusts its 4th token again (cells keyed by offset kept it low)."""
    calibrator = AcceptanceCalibrator()
    _, cells, _ = calibrator.continuation(REQUEST, 20, np.arange(1, 5))
    calibrator.update(cells, np.array([True, True, True, False]))
    fourth_after_rejection = calibrator.continuation(REQUEST, 20, np.array([4]))[0][0]
    for step in range(1, 6):  # the match grows by the 3 accepted tokens and the bonus token
        _, cells, _ = calibrator.continuation(REQUEST, 20 + 4 * step, np.arange(1, 4))
        calibrator.update(cells, np.array([True, True, True]))
    fourth_later = calibrator.continuation(REQUEST, 40, np.array([4]))[0][0]
    assert fourth_later > fourth_after_rejection and fourth_later > 0.9


def test_calibration_saved_with_the_old_cells_keeps_its_recycled_counts():
    from recap.core.calibration import LEGACY_CELLS

    old = AcceptanceCalibrator()
    recycled = recycled_cells(np.array([0.55]), np.array([1]))
    trials = np.zeros(LEGACY_CELLS)
    accepts = np.zeros(LEGACY_CELLS)
    trials[recycled] = 10
    accepts[recycled] = 9
    trials[-1] = accepts[-1] = 5  # an old continuation cell: meaningless now, dropped
    old.restore(trials, accepts)
    assert old.trials[recycled] == 10 and old.accepts[recycled] == 9
    assert old.trials[len(old.prior) - 2 * 16:].sum() == 0
    assert old.expected[recycled] == pytest.approx(10 * old.prior[recycled])
    with pytest.raises(ValueError):
        old.restore(np.zeros(7), np.zeros(7))
    n_cells = len(old.prior)
    with pytest.raises(ValueError):  # expected counts of another layout: nothing changes
        old.restore(np.ones(n_cells), np.zeros(n_cells), np.zeros(7))
    assert old.trials[recycled] == 10


# ----------------------------------------------------------------------------- opening chains
def test_an_opening_chain_learns_in_cells_of_its_own():
    """At the request's first step a long match is mostly the chat template: its cells are
    its own, and its later tokens start from `OPENING_PRIOR` once 5 tokens are matched."""
    from recap.core.calibration import OPENING_PRIOR

    calibrator = AcceptanceCalibrator()
    offsets = np.arange(1, 41)
    for source in (REQUEST, STORE):
        opening = continuation_cells(source, 8, offsets, opening=True)
        running = continuation_cells(source, 8, offsets)
        assert not set(opening.tolist()) & set(running.tolist())
        probs, cells, _ = calibrator.continuation(source, 8, offsets, opening=True)
        assert np.array_equal(cells, opening)
        assert probs[0] == pytest.approx(calibrator.continuation(source, 8, offsets[:1])[0][0])  # first: as running
        assert np.all(probs[1:] >= OPENING_PRIOR)
        assert np.all(calibrator.continuation(source, 8, offsets)[0][1:] < OPENING_PRIOR - 0.02)
        # A short opening match is a coincidence like any other until 5 tokens are matched.
        short, _, _ = calibrator.continuation(source, 1, np.arange(1, 6), opening=True)
        assert np.all(short[:4] < 0.7) and short[4] >= OPENING_PRIOR
    # Openings that fail teach the opening cells only.
    before = calibrator.continuation(REQUEST, 8, offsets)[0].copy()
    _, cells, _ = calibrator.continuation(REQUEST, 8, np.arange(1, 3), opening=True)
    for _ in range(5):
        calibrator.update(cells, np.array([True, False]))
    assert calibrator.continuation(REQUEST, 8, np.array([2]), opening=True)[0][0] < 0.5
    assert calibrator.continuation(REQUEST, 8, offsets)[0] == pytest.approx(before)


def test_calibration_saved_before_the_opening_cells_keeps_its_counts_as_running_ones():
    from recap.core.calibration import EVIDENCE_CELLS

    cells = continuation_cells(STORE, 20, np.array([1, 2]))
    trials = np.zeros(EVIDENCE_CELLS)
    accepts = np.zeros(EVIDENCE_CELLS)
    old = cells - 16  # the old layout had no request opening cells (16) before the store's
    trials[old] = 10
    accepts[old] = [9, 4]
    calibrator = AcceptanceCalibrator()
    calibrator.restore(trials, accepts)
    assert calibrator.trials[cells].tolist() == [10, 10] and calibrator.accepts[cells].tolist() == [9, 4]
    assert calibrator.trials.sum() == 20
