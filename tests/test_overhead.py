"""The model-free overhead benchmark: its synthetic target must be a faithful greedy target,
and its numbers must come from a real replay (recycling happens, every stage is timed)."""

from __future__ import annotations

import numpy as np
import pytest

from recap.core import ROOT, CostProfile, DraftTree
from recap.decoding import decode
from recap.overhead import SyntheticTarget, format_overhead, pack_tree, run_overhead
from recap.proposers import make_proposer

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
    assert drafted.tau > 1.2  # the drafts were actually accepted, not just empty trees


def test_pack_tree_mirrors_the_attention_mask():
    tree = DraftTree([5, 6, 7], [ROOT, 0, ROOT])
    tokens, positions, mask = pack_tree(4, tree, 10)
    assert tokens.tolist() == [4, 5, 6, 7]
    assert positions.tolist() == [10, 11, 12, 11]
    assert mask.shape == (4, 14)
    assert np.all(mask[:, :10] == 0)
    visible = mask[:, 10:] == 0
    np.testing.assert_array_equal(visible, tree.ancestor_matrix())


@pytest.mark.parametrize("engine", ["numba", "python"])
def test_run_overhead_reports_every_stage(engine):
    """The paper's RECAP: lookup+fusion, suffix and search timed apart."""
    result = run_overhead("recap-paper", vocab=VOCAB, requests=2, max_new_tokens=64, engine=engine)
    stages = {"propose", "suffix", "search", "packing", "observe", "refresh", "automaton"}
    # Only the Python engine can time fusion apart: the numba engine fuses inside the search call.
    assert set(result["stages"]) == (stages | {"fusion"} if engine == "python" else stages)
    _assert_sane_stages(result)
    medians = {name: stats["median_ms"] for name, stats in result["stages"].items()}
    assert medians["search"] < medians["propose"] and medians["refresh"] < medians["observe"]
    if engine == "python":
        assert medians["fusion"] < medians["propose"]
    assert result["tau"] > 1.3  # RECAP recycles the synthetic language's rows
    assert 30 < result["mean_tree_size"] <= 63 + 4
    assert "recap" in format_overhead(result) and "lookup+fusion" in format_overhead(result)


@pytest.mark.parametrize("engine", ["numba", "python"])
def test_run_overhead_reports_the_cost_aware_stages(engine):
    """Cost-aware RECAP: candidates (search + continuations) and the size choice."""
    result = run_overhead("recap", vocab=VOCAB, requests=2, max_new_tokens=64, engine=engine)
    assert set(result["stages"]) == {"propose", "candidates", "choice", "packing", "observe", "refresh", "automaton"}
    _assert_sane_stages(result)
    medians = {name: stats["median_ms"] for name, stats in result["stages"].items()}
    assert medians["candidates"] < medians["propose"] and medians["choice"] < medians["propose"]
    assert medians["refresh"] < medians["observe"]
    assert result["tau"] > 1.3
    assert 0 < result["mean_tree_size"] <= 63 + 2 * 40  # recycled candidates + two continuations at most
    assert "size choice" in format_overhead(result)


def _assert_sane_stages(result):
    for name, stats in result["stages"].items():
        assert stats["median_ms"] > 0, name
        assert stats["p95_ms"] >= stats["median_ms"], name
    medians = {name: stats["median_ms"] for name, stats in result["stages"].items()}
    assert result["total_ms_median"] >= medians["propose"]
    assert result["total_ms_p95"] >= result["total_ms_median"]
    assert result["iterations"] > 10


def test_run_overhead_other_methods_and_options():
    ar = run_overhead("ar", vocab=VOCAB, requests=1, max_new_tokens=32)
    assert ar["tau"] == 1.0 and ar["mean_tree_size"] == 0.0
    assert set(ar["stages"]) == {"propose", "packing", "observe"}
    small = run_overhead("recap", vocab=VOCAB, budget=7, requests=1, max_new_tokens=32, suffix_tokens=0)
    assert small["mean_tree_size"] <= 7
