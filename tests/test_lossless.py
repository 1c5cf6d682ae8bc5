"""End to end, float32: every drafter's output equals model.generate(do_sample=False).

Also the negative controls: deliberately broken verifiers must be caught by the same check.
"""

import numpy as np
import pytest

import recap
import recap.verifier.stock as stock_lane
from recap.check import run_check
from recap.core import ROOT, VerifiedTree
from recap.decoding import reference_generate
from recap.proposers import DecoyDrafter, make_proposer
from recap.proposers.pld import PromptLookupProposer
from recap.proposers.testing import RandomDrafter
from recap.verifier import QwenVLTarget, acceptance
from recap.verifier.kernels import ops
from tests.broken_verifiers import first_child_walk
from tests.conftest import load_target
from tests.helpers import ReferencePrimed, assert_drafted


class RecordingDecoy(DecoyDrafter):
    """The decoy drafter, remembering what the accepted paths looked like."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.steps = 0
        self.deep_trees = 0
        self.off_first_branch = 0
        self.max_nodes_seen = 0

    def observe(self, step: VerifiedTree) -> None:
        tree = step.tree
        self.steps += 1
        self.max_nodes_seen = max(self.max_nodes_seen, len(tree) + 1)
        self.deep_trees += tree.max_depth >= 5
        for node in step.accepted:
            siblings = [i for i in range(len(tree)) if tree.parents[i] == tree.parents[node]]
            self.off_first_branch += siblings[0] != node


def _assert_all_passed(report):
    failures = [(case.index, case.first_difference) for case in report.cases if not case.passed]
    assert not failures, f"{len(failures)} mismatches (case, first differing token): {failures}"


def test_decoy_trees_are_lossless_on_tiny_architectures(tiny_target):
    drafter = RecordingDecoy(seed=3)
    report = run_check(tiny_target, drafter, prompts=30, max_new_tokens=40, vary=True, seed=1)
    _assert_all_passed(report)
    cases = report.cases
    assert len(cases) == 30
    if tiny_target.accepts_images:
        assert sum(case.has_image for case in cases) >= 20 and not all(case.has_image for case in cases)
    # The check must have exercised what it claims to.
    assert_drafted(report, min_accepted=100)
    assert report.tau > 2.0
    assert drafter.off_first_branch > 10 and drafter.deep_trees > 10
    assert drafter.max_nodes_seen > 50
    # EOS and the token limit both landed inside accepted paths (tokens after them dropped).
    assert sum(case.cut_inside_path and case.stop_reason == "eos" for case in cases) >= 2
    assert sum(case.cut_inside_path and case.stop_reason == "length" for case in cases) >= 2


class PrimedPld(ReferencePrimed, PromptLookupProposer):
    """PLD's own lookup, over the reference on every other request (tests/helpers.py)."""


class CountingRandom(RandomDrafter):
    """The random drafter, counting the nodes it drafts."""

    drafted = 0

    def propose(self, history, limits=None):
        tree = super().propose(history, limits)
        self.drafted += len(tree)
        return tree


@pytest.mark.no_accepted_drafts(reason="AR drafts nothing; random trees are all rejected (the decoy tests accept)")
def test_ar_and_random_trees_are_lossless_on_tiny_architectures(tiny_target):
    """AR drafts nothing; random trees are (on these models) all rejected: the rejection path."""
    _assert_all_passed(run_check(tiny_target, "ar", prompts=10, max_new_tokens=32, vary=True, seed=2))
    random = CountingRandom()
    _assert_all_passed(run_check(tiny_target, random, prompts=10, max_new_tokens=32, vary=True, seed=2))
    assert random.drafted > 1000  # whole trees were verified and thrown away


def test_pld_is_lossless_with_accepted_drafts_on_tiny_architectures(tiny_target):
    report = run_check(tiny_target, PrimedPld(), prompts=10, max_new_tokens=32, vary=True, seed=2)
    _assert_all_passed(report)
    assert_drafted(report, min_accepted=30)
    assert any(case.cut_inside_path for case in report.cases)


def test_decoy_trees_are_lossless_with_quad_attention(monkeypatch):
    """The tiny models' 2 query heads per kv head are below `QuadAttention.MIN_GROUPS`: with
    the threshold lowered, decoy trees on the M-RoPE model (text and images) run through
    quad attention and stay lossless against plain decoding on the same kernels."""
    monkeypatch.setattr(ops.QuadAttention, "MIN_GROUPS", 1)
    target = recap.load("tiny-qwen2.5-vl", kernels="fast")
    assert target.decoder.quad_attention is not None
    report = run_check(target, RecordingDecoy(seed=5), prompts=10, max_new_tokens=30, vary=True, seed=2)
    _assert_all_passed(report)
    assert_drafted(report, min_accepted=30)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["decoy", "pld"])
def test_lossless_on_real_smollm2(smollm2, method):
    report = run_check(smollm2, method, prompts=5, max_new_tokens=24, vary=method == "decoy", seed=4)
    _assert_all_passed(report)
    assert_drafted(report, min_accepted=20 if method == "decoy" else 1)
    if method == "decoy":
        assert report.tau > 2.0


# ----------------------------------------------------------------------------- negative controls
def test_siblings_seeing_each_other_is_detected(monkeypatch):
    """A causal mask over the packed tree lets each node see earlier siblings' branches."""
    monkeypatch.setattr(stock_lane, "tree_attention_mask", _leaky(stock_lane.tree_attention_mask))
    report = run_check(load_target("tiny-llama", kernels="stock"), DecoyDrafter(seed=5), prompts=8,
                       max_new_tokens=32, seed=5)
    assert report.failed > 0


def test_siblings_seeing_each_other_is_detected_on_fast_kernels(tiny_llama, monkeypatch):
    """The fast path's version of the leak: every packed node attends to all earlier ones."""
    from recap.core import DraftTree

    def causal_lists(tree):
        n = len(tree) + 1
        starts = np.array([i * (i + 1) // 2 for i in range(n + 1)], dtype=np.int64)
        return starts, np.concatenate([np.arange(i + 1) for i in range(n)]).astype(np.int64)

    assert tiny_llama.kernels == "fast"
    monkeypatch.setattr(DraftTree, "ancestor_lists", causal_lists)
    report = run_check(tiny_llama, DecoyDrafter(seed=5), prompts=8, max_new_tokens=32, seed=5)
    assert report.failed > 0


def _leaky(real_mask):
    def leaky_mask(allowed, past_len, dtype, device):
        return real_mask(np.tril(np.ones_like(allowed)), past_len, dtype, device)

    return leaky_mask


@pytest.mark.parametrize("kernels", ["stock", "fast"])
def test_positions_without_mrope_delta_are_detected(kernels, monkeypatch):
    """On stock, against generate; on fast, plain decoding shares the wrong offset, so the
    check is agreement with stock generate, which computes its own positions."""
    from recap.prompts import check_prompts

    target = load_target("tiny-qwen2.5-vl", kernels=kernels)
    original = QwenVLTarget.prompt_positions

    def without_delta(self, inputs):
        return original(self, inputs)[0], 0

    monkeypatch.setattr(QwenVLTarget, "prompt_positions", without_delta)
    if kernels == "stock":
        report = run_check(target, DecoyDrafter(seed=6), prompts=8, max_new_tokens=32, seed=6)
        assert report.failed > 0
        return
    differing = 0
    for prompt, image in check_prompts(8, images=True):
        inputs = target.prepare(prompt, image)
        differing += reference_generate(target, inputs, 24) != target.stock_generate(inputs, 24)
    assert differing > 0


def test_accepting_the_first_child_is_detected(tiny_llama, monkeypatch):
    """A verifier that walks into the first child whatever the argmax says."""

    monkeypatch.setattr(acceptance, "greedy", first_child_walk)
    report = run_check(tiny_llama, DecoyDrafter(seed=7), prompts=6, max_new_tokens=24, seed=7)
    assert report.failed > 0


def test_the_decoy_drafter_hides_the_truth_behind_decoys(tiny_llama):
    """Sanity of the adversary itself: the true token is often not the first child."""
    inputs = tiny_llama.prepare("Decoys?")
    reference = reference_generate(tiny_llama, inputs, 12)
    drafter = DecoyDrafter(inputs.prompt_ids + reference, seed=0)
    drafter.begin_request(tiny_llama.prefill(inputs)[0])
    history = inputs.prompt_ids + reference[:1]
    hidden = 0
    for _ in range(50):
        tree = drafter.propose(history)
        assert len(tree) + 1 <= 68 and tree.max_depth <= 10
        roots = [i for i in range(len(tree)) if tree.parents[i] == ROOT]
        hidden += bool(roots) and tree.tokens[roots[0]] != reference[1] and reference[1] in tree.tokens[roots]
    assert hidden >= 10
    tiny_llama.release()


def test_make_proposer_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown method"):
        make_proposer("nope")
