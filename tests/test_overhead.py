"""The model-free overhead benchmark: its synthetic target must be a faithful greedy target,
and its numbers must come from a real replay (recycling happens, every stage is timed, and
timed as itself). Stage times are checked on a virtual clock that counts the work charged to
each stage; real timings belong to benchmarks/overhead.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from recap import decoding, overhead
from recap.core import ROOT, CostProfile, DraftTree, timing
from recap.decoding import decode
from recap.overhead import SyntheticTarget, format_overhead, pack_tree, run_overhead
from recap.proposers import PromptLookupProposer, RecapProposer, make_proposer
from tests.helpers import assert_drafted

VOCAB = 4096


@pytest.fixture(scope="module")
def target() -> SyntheticTarget:
    return SyntheticTarget(VOCAB, seed=0)


def test_deterministic_per_seed(target):
    again = SyntheticTarget(VOCAB, seed=0)
    other = SyntheticTarget(VOCAB, seed=1)
    prompt = target.sample_prompt(200, seed=5)
    assert prompt == again.sample_prompt(200, seed=5)
    assert prompt != target.sample_prompt(200, seed=6)
    rows, first = target.prefill(prompt)
    rows_again, first_again = again.prefill(prompt)
    assert first == first_again
    np.testing.assert_array_equal(rows.topk_ids, rows_again.topk_ids)
    np.testing.assert_array_equal(rows.topk_logits, rows_again.topk_logits)
    assert not np.array_equal(rows.topk_ids, other.prefill(prompt)[0].topk_ids)
    # Top-K rows: distinct ids, logits highest first, argmax first.
    assert all(len(set(row)) == target.top_k for row in rows.topk_ids.tolist())
    assert np.all(np.diff(rows.topk_logits, axis=1) <= 0)


def test_text_repeats_without_looping(target):
    prompt = target.sample_prompt(384, seed=1)
    output = target.greedy(prompt, 128)
    assert 0.3 < len(set(prompt)) / len(prompt) < 0.8  # repetition, as in text
    assert len(set(output)) > 48  # greedy output does not collapse into a short loop


def test_verify_uses_each_nodes_own_path(target):
    """Every packed row equals the reference computed from the node's full path."""
    prompt = target.sample_prompt(50, seed=2)
    _, root = target.prefill(prompt)
    truth = target.greedy([*prompt, root], 4)
    tree = DraftTree([truth[0], 7, truth[1], truth[0], 9], [ROOT, ROOT, 0, 1, 2])
    step = target.verify(root, tree)
    assert step.accepted == [0, 2]
    history = [*prompt, root]
    for position in range(len(tree) + 1):
        path = history + (tree.path_tokens(position - 1) if position else [])
        ids, logits, argmax = target.rows(target._context_of(path))
        np.testing.assert_array_equal(step.topk_ids[position], ids[0])
        np.testing.assert_array_equal(step.topk_logits[position], logits[0])
        assert step.argmax[position] == argmax[0]
    assert step.committed == truth[:3]
    target.commit(step.accepted)  # the next root's context is the accepted path
    assert target.verify(step.committed[-1], DraftTree.empty()).argmax[0] == truth[3]


@pytest.mark.parametrize("method", ["recap", "recap-paper", "pld"])
def test_decode_is_lossless_on_the_synthetic_target(target, method):
    prompt = target.sample_prompt(300, seed=3)
    reference = target.greedy(prompt, 96)
    ar = decode(target, make_proposer("ar"), prompt, max_new_tokens=96)
    proposer = make_proposer(method)
    # The synthetic target has no verify-cost profile of its own: cost-aware RECAP gets a CPU-like one.
    cost = CostProfile.linear(0.06) if getattr(proposer, "wants_cost", False) else None
    drafted = decode(target, proposer, prompt, max_new_tokens=96, cost=cost)
    assert ar.tokens == reference
    assert drafted.tokens == reference
    assert_drafted(drafted, min_accepted=10)  # the drafts were accepted, not just empty trees
    assert drafted.tau > 1.2


def test_pack_tree_mirrors_the_attention_mask():
    tree = DraftTree([5, 6, 7], [ROOT, 0, ROOT])
    tokens, positions, mask = pack_tree(4, tree, 10)
    assert tokens.tolist() == [4, 5, 6, 7]
    assert positions.tolist() == [10, 11, 12, 11]
    assert mask.shape == (4, 14)
    assert np.all(mask[:, :10] == 0)
    visible = mask[:, 10:] == 0
    np.testing.assert_array_equal(visible, tree.ancestor_matrix())


class VirtualClock:
    """``time.perf_counter`` for the loop (`recap.decoding`), the proposer's own stage timers
    (`recap.core.timing`) and the target's packing (`recap.overhead`): time moves only when a
    charged function runs, by its known cost, so every reported time is an exact count of the
    work done in it (no wall clock here: timings themselves are `benchmarks/overhead.py`'s)."""

    COSTS_MS = {"sync_automaton": 1, "search": 2, "add_suffix": 4, "candidates": 16, "select": 32,
                "refresh": 64, "absorb": 128, "pack_tree": 256}
    """Distinct powers of two: a stage charged with another stage's work shows in its time."""

    def __init__(self):
        self.now = 0.0
        self.calls = dict.fromkeys(self.COSTS_MS, 0)

    def perf_counter(self) -> float:
        return self.now

    def advance(self, milliseconds: float) -> None:
        self.now += milliseconds * 1e-3

    def charged(self, name: str, real):
        def run(*args, **kwargs):
            self.calls[name] += 1
            self.advance(self.COSTS_MS[name])
            return real(*args, **kwargs)

        return run


@pytest.fixture
def clock(monkeypatch) -> VirtualClock:
    """The virtual clock everywhere a time is read; nothing charged yet."""
    clock = VirtualClock()
    fake = SimpleNamespace(perf_counter=clock.perf_counter)
    for module in (overhead, decoding, timing):
        monkeypatch.setattr(module, "time", fake)
    return clock


@pytest.fixture
def charged(clock, monkeypatch) -> VirtualClock:
    """The clock, with RECAP's parts and the packing charged their known costs (the test
    wraps them; `run_overhead` itself only calls the proposer's public methods)."""
    monkeypatch.setattr(overhead, "pack_tree", clock.charged("pack_tree", overhead.pack_tree))
    for name in clock.COSTS_MS:
        if name != "pack_tree":
            monkeypatch.setattr(RecapProposer, name, clock.charged(name, getattr(RecapProposer, name)))
    return clock


def _medians(result) -> dict[str, float]:
    return {name: stats["median_ms"] for name, stats in result["stages"].items()}


class RecordingDrafter(PromptLookupProposer):
    """PLD whose every ``propose`` and ``observe`` is recorded and costs a known virtual time:
    what `run_overhead` reports must be these very calls."""

    name = "recording"
    PROPOSE_MS, OBSERVE_MS = 3.0, 5.0

    def __init__(self, clock: VirtualClock):
        super().__init__()
        self.clock = clock
        self.requests = -1
        self.proposed: list[tuple[int, int]] = []
        """(request, tree size) of every ``propose``, the warm-up request (0) included."""
        self.observed = 0

    def begin_request(self, prompt):
        super().begin_request(prompt)
        self.requests += 1

    def propose(self, history, limits=None):
        self.clock.advance(self.PROPOSE_MS)
        tree = super().propose(history, limits)
        self.proposed.append((self.requests, len(tree)))
        return tree

    def observe(self, step):
        self.clock.advance(self.OBSERVE_MS)
        self.observed += 1
        super().observe(step)


def test_run_overhead_times_the_methods_own_propose_and_observe(clock):
    made: list[RecordingDrafter] = []

    def build() -> RecordingDrafter:
        made.append(RecordingDrafter(clock))
        return made[-1]

    result = run_overhead(build, vocab=VOCAB, requests=2, max_new_tokens=48)
    (drafter,) = made  # one stream, one proposer object
    assert result["method"] == "recording" and drafter.requests == 2
    assert len(drafter.proposed) == drafter.observed  # every proposed tree was verified and observed
    counted = [size for request, size in drafter.proposed if request > 0]
    assert len(counted) == result["iterations"] < len(drafter.proposed)  # the warm-up ran, uncounted
    assert result["mean_tree_size"] == pytest.approx(np.mean(counted)) and max(counted) > 0
    medians = _medians(result)
    assert set(medians) == {"propose", "packing", "observe"}  # PLD times no parts of its own
    assert medians["propose"] == pytest.approx(RecordingDrafter.PROPOSE_MS)
    assert medians["observe"] == pytest.approx(RecordingDrafter.OBSERVE_MS)
    assert medians["packing"] == 0.0  # only the drafter moves the clock here
    assert result["tau"] > 1.0


def test_run_overhead_reports_the_papers_stages_as_recap_times_them(charged):
    """The paper's RECAP: search and suffix, refresh and automaton, each charged exactly the
    work done inside it by the proposer's own timers, in the real propose and observe."""
    result = run_overhead("recap-paper", vocab=VOCAB, requests=2, max_new_tokens=64)
    assert set(result["stages"]) == {"propose", "search", "suffix", "packing", "observe", "refresh", "automaton"}
    _assert_sane_stages(result)
    cost, medians = charged.COSTS_MS, _medians(result)
    assert charged.calls["candidates"] == charged.calls["select"] == 0  # the paper's tree: one search a step
    assert medians["search"] == pytest.approx(cost["search"])
    assert medians["suffix"] == pytest.approx(cost["sync_automaton"] + cost["add_suffix"])
    assert medians["propose"] == pytest.approx(cost["sync_automaton"] + cost["search"] + cost["add_suffix"])
    assert medians["refresh"] == pytest.approx(cost["refresh"])
    assert medians["automaton"] == pytest.approx(cost["absorb"])
    assert medians["observe"] == pytest.approx(cost["refresh"] + cost["absorb"])
    assert medians["packing"] == pytest.approx(cost["pack_tree"])
    assert result["tau"] > 1.3  # RECAP recycles the synthetic language's rows
    assert 30 < result["mean_tree_size"] <= 63 + 4
    assert "recap" in format_overhead(result) and "search" in format_overhead(result)


def test_run_overhead_reports_the_cost_aware_stages_as_recap_times_them(charged):
    """Cost-aware RECAP: candidates (search + continuations) and the size choice."""
    result = run_overhead("recap", vocab=VOCAB, requests=2, max_new_tokens=64)
    assert set(result["stages"]) == {"propose", "candidates", "choice", "packing", "observe", "refresh", "automaton"}
    _assert_sane_stages(result)
    cost, medians = charged.COSTS_MS, _medians(result)
    assert charged.calls["search"] == 0  # the compiled search runs inside candidates
    assert medians["candidates"] == pytest.approx(cost["sync_automaton"] + cost["candidates"])
    assert medians["choice"] == pytest.approx(cost["select"])
    assert medians["propose"] == pytest.approx(medians["candidates"] + cost["select"])
    assert medians["refresh"] == pytest.approx(cost["refresh"])
    assert medians["observe"] == pytest.approx(cost["refresh"] + cost["absorb"])
    assert medians["packing"] == pytest.approx(cost["pack_tree"])
    assert result["tau"] > 1.3
    assert 0 < result["mean_tree_size"] <= 63 + 2 * 40  # recycled candidates + two continuations at most
    assert "size choice" in format_overhead(result)


def _assert_sane_stages(result):
    for name, stats in result["stages"].items():
        assert stats["median_ms"] > 0, name
        assert stats["p95_ms"] >= stats["median_ms"], name
    medians = _medians(result)
    # packing and observe cost the same every step here: the median total is the sum of medians
    assert result["total_ms_median"] == pytest.approx(medians["propose"] + medians["packing"] + medians["observe"])
    assert result["total_ms_p95"] >= result["total_ms_median"]
    assert result["iterations"] > 10


def test_run_overhead_other_methods_and_options():
    ar = run_overhead("ar", vocab=VOCAB, requests=1, max_new_tokens=32)
    assert ar["tau"] == 1.0 and ar["mean_tree_size"] == 0.0
    assert set(ar["stages"]) == {"propose", "packing", "observe"}
    small = run_overhead("recap", vocab=VOCAB, budget=7, requests=1, max_new_tokens=32, suffix_tokens=0)
    assert small["mean_tree_size"] <= 7
