"""Cost-aware RECAP (``recap``) and the paper's RECAP (``recap-paper``) end to end, float32:
losslessness with drafts actually accepted, the negative control, tree sizes under flat and
steep cost profiles, arbitrary memory and store contents, calibration inside a stream, and
what proposers learn when EOS or the token limit cuts an accepted path.

Random-weight models only repeat themselves when asked the same thing twice, so the streams
here send each request twice: the second one is drafted from U and the output store.
Every decode gets an explicit cost profile: nothing here measures the machine."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import recap
import recap.check as check_module
from recap.check import run_check
from recap.core import CostProfile, DraftTree
from recap.decoding import decode, reference_generate
from recap.prompts import TEXT_PROMPTS, check_prompts
from recap.proposers import LookaheadProposer, RecapConfig, RecapPaperProposer, RecapProposer
from recap.verifier import acceptance
from tests.broken_verifiers import first_child_walk
from tests.helpers import assert_drafted

PROFILE = CostProfile.linear(0.05)
"""A real (non-flat) curve: t(N) = 1 + 0.05 (N - 1)."""
STEEP = CostProfile(sizes=[1, 2], contexts=[0], times=[[1.0, 2.0]])
"""t(2) = 2 t(1): no draft can pay for itself."""


@pytest.fixture(autouse=True)
def _never_measure(monkeypatch):
    """A decode without an explicit profile would measure (and cache) one: refuse it."""

    def refuse(self):
        raise AssertionError("a test decode asked the target to measure its verify cost")

    monkeypatch.setattr(recap.TargetModel, "verify_cost", refuse)


def _check(monkeypatch, target, proposer, items, cost, *, vary=True, seed=0, max_new_tokens=40):
    """`run_check` over ``items`` with every decode given ``cost``."""

    def decode_with_cost(*args, **kwargs):
        if kwargs.get("cost") is None:
            kwargs["cost"] = cost
        return decode(*args, **kwargs)

    monkeypatch.setattr(check_module, "decode", decode_with_cost)
    return run_check(target, proposer, max_new_tokens=max_new_tokens, vary=vary, seed=seed, items=items)


def _repeated_items(target, count):
    """``count`` built-in (prompt, image) pairs, each sent twice in a row."""
    return [item for item in check_prompts(count, images=target.accepts_images) for _ in range(2)]


def _assert_all_passed(report):
    failures = [(case.index, case.first_difference) for case in report.cases if not case.passed]
    assert not failures, f"{len(failures)} mismatches (case, first differing token): {failures}"


# ----------------------------------------------------------------------------- losslessness
def test_cost_aware_recap_is_lossless_and_accepts_drafts_on_tiny_architectures(tiny_target, monkeypatch):
    proposer = RecapProposer()
    assert proposer.wants_cost and proposer.name == "recap"
    report = _check(monkeypatch, tiny_target, proposer, _repeated_items(tiny_target, 4), PROFILE, seed=21)
    _assert_all_passed(report)
    assert_drafted(report)
    assert max(proposer.chosen_sizes) > 0 and min(proposer.chosen_sizes) >= 0


def test_paper_recap_is_lossless_and_accepts_drafts_on_tiny_architectures(tiny_target, monkeypatch):
    proposer = RecapPaperProposer()
    assert not proposer.wants_cost and proposer.name == "recap-paper"
    report = _check(monkeypatch, tiny_target, proposer, _repeated_items(tiny_target, 4), None, seed=22)
    _assert_all_passed(report)
    assert_drafted(report)


def test_a_wrong_verifier_makes_the_recap_check_fail(tiny_llama, monkeypatch):
    """Negative control: the same check, with a walk that accepts the first child regardless."""
    monkeypatch.setattr(acceptance, "greedy", first_child_walk)
    report = _check(monkeypatch, tiny_llama, RecapProposer(), _repeated_items(tiny_llama, 3), CostProfile.flat(),
                    vary=False, max_new_tokens=24, seed=23)
    assert report.failed > 0


# ----------------------------------------------------------------------------- tree sizes
def _stream(target, proposer, prompts, cost, max_new_tokens=40):
    results = []
    for prompt in prompts:
        results.append(decode(target, proposer, target.prepare(prompt), max_new_tokens=max_new_tokens, cost=cost))
    return results


def test_flat_cost_drafts_large_trees_and_steep_cost_drafts_none(tiny_llama):
    prompt = TEXT_PROMPTS[2]
    flat = RecapProposer()
    _stream(tiny_llama, flat, [prompt], CostProfile.flat())  # a random model's first answer: nothing recycled yet
    warm = len(flat.chosen_sizes)
    results = _stream(tiny_llama, flat, [prompt] * 3, CostProfile.flat())
    sizes = flat.chosen_sizes[warm:]
    assert len(sizes) == sum(len(r.iterations) for r in results)
    assert np.mean(sizes) >= 48, sizes
    assert max(sizes) > 63  # continuations on top of the 63 recycled candidates: no fixed cap
    assert all(r.tau > 4 for r in results)

    steep = RecapProposer()
    results = _stream(tiny_llama, steep, [prompt] * 4, STEEP)
    assert steep.chosen_sizes and max(steep.chosen_sizes) == 0  # a fresh stream under a steep curve
    assert all(it.draft_size == 0 for r in results for it in r.iterations)


def test_no_cost_ablation_keeps_the_fixed_budget(tiny_llama):
    proposer = RecapProposer(ablation="no-cost")
    assert not proposer.wants_cost
    _stream(tiny_llama, proposer, [TEXT_PROMPTS[3]] * 3, STEEP)  # the steep curve is ignored
    assert max(proposer.chosen_sizes) == 63


# ----------------------------------------------------------------------------- any memory, any store
@st.composite
def _unigram_rows(draw, vocab, history):
    """Random U rows (keys, ids, probs), some keyed by the reference history pointing at its
    next token so drafts get accepted, some garbage, some probabilities zero."""
    keys, ids, probs = [], [], []
    for _ in range(draw(st.integers(0, 25))):
        width = draw(st.integers(1, 8))
        keys.append(draw(st.integers(0, vocab - 1)))
        ids.append(draw(st.lists(st.integers(0, vocab - 1), min_size=width, max_size=width, unique=True)))
        probs.append(draw(st.lists(st.sampled_from([0.0, 0.1, 0.5, 1.0]), min_size=width, max_size=width)))
    for position in draw(st.lists(st.integers(0, len(history) - 2), max_size=20)):
        keys.append(history[position])
        ids.append([history[position + 1], draw(st.integers(0, vocab - 1))])
        probs.append([draw(st.floats(0.05, 1.0)), draw(st.floats(0.0, 1.0))])
    rows = np.zeros((len(keys), 8), dtype=np.int64), np.zeros((len(keys), 8))
    for i, (row_ids, row_probs) in enumerate(zip(ids, probs)):
        row_probs = list(row_probs)
        if len(set(row_ids)) < len(row_ids):  # a decoy equal to the true token: keep one
            row_ids, row_probs = row_ids[:1], row_probs[:1]
        if not any(row_probs):
            row_probs[0] = 1.0
        rows[0][i, : len(row_ids)] = row_ids
        rows[1][i, : len(row_ids)] = row_probs
    return np.asarray(keys, dtype=np.int64), rows[0], rows[1]


_MEMORY_CASE: dict = {}


def _memory_case(target):
    if not _MEMORY_CASE:
        inputs = target.prepare("Whatever the memory holds.")
        _MEMORY_CASE.update(inputs=inputs, reference=reference_generate(target, inputs, 20))
    return _MEMORY_CASE["inputs"], _MEMORY_CASE["reference"]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_memory_or_store_content_changes_only_speed(tiny_llama, data):
    inputs, reference = _memory_case(tiny_llama)
    history = inputs.prompt_ids + reference
    vocab = tiny_llama.vocab_size
    keys, ids, probs = data.draw(_unigram_rows(vocab, history))
    proposer = RecapProposer()
    # Earlier "outputs" of the stream: random, or pieces of the true answer with wrong tails.
    for _ in range(data.draw(st.integers(0, 4))):
        if data.draw(st.booleans()):
            start = data.draw(st.integers(0, len(history) - 2))
            piece = history[start : start + data.draw(st.integers(1, 12))]
            proposer.store.add(piece + data.draw(st.lists(st.integers(0, vocab - 1), max_size=6)))
        else:
            proposer.store.add(data.draw(st.lists(st.integers(0, vocab - 1), max_size=30)))
    original = proposer.begin_request

    def begin(prompt):
        original(prompt)
        proposer.memory.load_unigram(keys, ids, probs)

    proposer.begin_request = begin
    cost = data.draw(st.sampled_from([CostProfile.flat(), PROFILE, CostProfile.linear(0.3)]))
    result = decode(tiny_llama, proposer, inputs, max_new_tokens=20, cost=cost)
    assert result.tokens == reference
    assert proposer.store.outputs[-1] == reference


@pytest.mark.lossless
@pytest.mark.parametrize("source", ["rows", "store"])
def test_true_rows_or_a_stored_answer_are_drafted_and_accepted(tiny_llama, source):
    """What the property test above draws does reach the drafts: the true next token's row at
    every position, or the true answer in the store, gives accepted drafts (still greedy)."""
    inputs, reference = _memory_case(tiny_llama)
    history = inputs.prompt_ids + reference
    proposer = RecapProposer()
    if source == "store":
        proposer.store.add(list(reference))
    else:
        first = {}
        for position in range(len(inputs.prompt_ids) - 1, len(history) - 1):
            first.setdefault(history[position], history[position + 1])
        keys = np.array(list(first), dtype=np.int64)
        ids, probs = np.zeros((len(keys), 8), dtype=np.int64), np.zeros((len(keys), 8))
        ids[:, 0], probs[:, 0] = list(first.values()), 1.0
        original = proposer.begin_request

        def begin(prompt):
            original(prompt)
            proposer.memory.load_unigram(keys, ids, probs)

        proposer.begin_request = begin
    result = decode(tiny_llama, proposer, inputs, max_new_tokens=20, cost=PROFILE)
    assert result.tokens == reference
    assert_drafted(result, min_accepted=8)


# ----------------------------------------------------------------------------- the paper's configuration
def test_recap_paper_draws_the_paper_trees(tiny_llama):
    paper = RecapPaperProposer()
    plain = RecapProposer(RecapConfig(cost_aware=False, calibration=False, long_continuation=False,
                                      stream_store=False))
    trees = [[], []]
    for proposer, drawn in zip((paper, plain), trees):
        original = proposer.propose

        def propose(history, limits=None, original=original, drawn=drawn):
            tree = original(history, limits)
            drawn.append((tree.tokens.tolist(), tree.parents.tolist()))
            return tree

        proposer.propose = propose
        # The steep profile would cut a cost-aware tree to nothing; these ignore it.
        _stream(tiny_llama, proposer, [TEXT_PROMPTS[4], TEXT_PROMPTS[4], TEXT_PROMPTS[5], TEXT_PROMPTS[5]], STEEP)
    assert trees[0] == trees[1]
    sizes = [len(tokens) for tokens, _ in trees[0]]
    assert max(sizes) <= 63 + 4
    assert max(sizes) >= 63  # the fixed budget was reached
    assert not paper.chosen_sizes and not plain.chosen_sizes  # nothing chosen: the same tree every step


# ----------------------------------------------------------------------------- calibration
def test_calibration_learns_inside_a_stream(tiny_llama):
    proposer = RecapProposer()
    prior = proposer.calibrator.estimate(np.arange(len(proposer.calibrator.prior))).copy()
    _stream(tiny_llama, proposer, [TEXT_PROMPTS[6]] * 3 + [TEXT_PROMPTS[7]] * 2, PROFILE)
    calibrator = proposer.calibrator
    report = calibrator.reliability()
    assert report["labels"] > 0 and report["ece"] is not None
    assert calibrator.trials.sum() >= report["labels"]  # every labelled node labels its cells
    assert not np.allclose(calibrator.estimate(np.arange(len(prior))), prior)
    disabled = RecapProposer(ablation="no-calibration")
    _stream(tiny_llama, disabled, [TEXT_PROMPTS[6]] * 3, PROFILE)
    assert disabled.calibrator.trials.sum() == 0
    assert disabled.calibrator.reliability()["labels"] > 0  # still reported, never learned
    proposer.reset_stream()
    assert proposer.calibrator.trials.sum() == 0 and len(proposer.store) == 0 and not proposer.chosen_sizes


# ----------------------------------------------------------------------------- cut paths are not learned
class _TruthfulLookahead(LookaheadProposer):
    """Lookahead whose drafts are the true continuation (a long chain, always accepted); the
    trie learns through Lookahead's own observe."""

    def __init__(self, truth, depth=20):
        super().__init__()
        self.truth = list(truth)
        self.depth = depth

    def propose(self, history, limits=None):
        super().propose(history, limits)
        chain = self.truth[len(history) : len(history) + self.depth]
        return DraftTree(chain, list(range(-1, len(chain) - 1)))


@pytest.mark.parametrize("cut", ["length", "eos"])
def test_lookahead_never_learns_tokens_past_the_cut(tiny_llama, cut):
    inputs = tiny_llama.prepare("Lookahead cut test.")
    reference = reference_generate(tiny_llama, inputs, 40)
    prompt = inputs.prompt_ids
    proposer = _TruthfulLookahead(prompt + reference)
    if cut == "length":
        result = decode(tiny_llama, proposer, inputs, max_new_tokens=7, cost=None)
        assert result.stop_reason == "length"
    else:
        eos = reference[6]
        assert eos not in reference[:6]
        result = decode(tiny_llama, proposer, inputs, max_new_tokens=40, eos_token_ids=[eos])
        assert result.stop_reason == "eos"
    kept = reference[:7]
    assert result.tokens == kept and result.cut_inside_path
    dropped = [t for t in reference[7:27] if t not in set(prompt + kept)]
    assert dropped
    trie = proposer.trie
    text = prompt + kept
    assert trie.counts(text[-3:]) is not None  # the kept tail was learned
    for token in dropped:
        assert trie.counts([token]) is None  # no window starts past the cut
    for start in range(max(0, len(text) - trie.window), len(text)):
        assert trie.counts([*text[start:], reference[7]]) is None  # none runs across it


@pytest.mark.parametrize("cut", ["length", "eos"])
def test_recap_remembers_exactly_the_returned_tokens(tiny_llama, cut):
    inputs = tiny_llama.prepare(TEXT_PROMPTS[8])
    proposer = RecapProposer()
    first = decode(tiny_llama, proposer, inputs, max_new_tokens=40, cost=CostProfile.flat())
    assert proposer.store.outputs[-1] == first.tokens
    if cut == "length":
        second = decode(tiny_llama, proposer, inputs, max_new_tokens=6, cost=CostProfile.flat())
    else:
        eos = first.tokens[5]
        assert eos not in first.tokens[:5]
        second = decode(tiny_llama, proposer, inputs, max_new_tokens=40, eos_token_ids=[eos],
                        cost=CostProfile.flat())
    assert second.tokens == first.tokens[:6]
    assert sum(it.accepted for it in second.iterations) > 0  # the repeat was drafted and accepted
    # EOS is a surprise, so the repeat runs past it; the token limit is known, so no draft does.
    assert second.cut_inside_path == (cut == "eos")
    assert proposer.store.outputs[-1] == second.tokens
    assert len(proposer.store.outputs) == 2
    assert proposer.request.automaton.tokens == inputs.prompt_ids + second.tokens


# ----------------------------------------------------------------------------- long continuations
def test_a_failing_recycled_correction_leaves_a_stored_answer_drafted(tiny_llama):
    """The request's correction scales recycled estimates only: even with it at 0.004 (its
    recycled drafts 'failed' 1000 times), the stored answer is still drafted whole and
    accepted. Applied to every node, it compounded along the chain and drafted nothing."""
    inputs, reference = _memory_case(tiny_llama)
    proposer = RecapProposer()
    proposer.store.add(list(reference))
    original = proposer.begin_request

    def begin(prompt):
        original(prompt)
        proposer.request.expected = 1000.0

    proposer.begin_request = begin
    result = decode(tiny_llama, proposer, inputs, max_new_tokens=20, cost=PROFILE)
    assert result.tokens == reference[:20]
    assert proposer.request.factor < 0.01
    assert_drafted(result, min_accepted=10)


def test_a_short_match_into_a_trusted_copy_offers_more_than_sams_cap(tiny_llama):
    """A continuation is offered 16 tokens per matched token (`continuation_growth`), not
    SAM's 4: whether they are drafted is the chooser's call. With verification free (flat
    profile) the stored answer's first chain runs past 4 x its match and is accepted whole;
    the output stays greedy."""
    inputs, reference = _memory_case(tiny_llama)
    proposer = RecapProposer()
    proposer.store.add(list(reference))
    matches, original = [], proposer.candidates

    def candidates(history, room=None):
        found = original(history, room)
        matches.append(proposer.request.store_match.length)
        return found

    proposer.candidates = candidates
    seen = _record_proposals(proposer)
    result = decode(tiny_llama, proposer, inputs, max_new_tokens=20, cost=CostProfile.flat())
    assert result.tokens == reference[:20]
    first = seen[0][2]
    assert matches[0] >= 1 and first.max_depth > 4 * matches[0]
    assert result.iterations[0].accepted > 4 * matches[0]
    assert RecapConfig().continuation_length(3) == 48 and RecapConfig().continuation_length(3, room=10) == 10
    assert RecapConfig(continuation_growth=4).continuation_length(3) == 12
    with pytest.raises(recap.InputError):
        RecapConfig(continuation_growth=0)


def _record_proposals(proposer) -> list:
    """Wrap ``proposer.propose`` to record (history length, limits, tree) of every step."""
    seen, original = [], proposer.propose

    def propose(history, limits=None):
        tree = original(history, limits)
        seen.append((len(history), limits, tree))
        return tree

    proposer.propose = propose
    return seen


def test_drafts_never_reach_past_the_tokens_the_request_may_still_commit(tiny_llama):
    inputs, reference = _memory_case(tiny_llama)
    proposer = RecapProposer()
    proposer.store.add(list(reference))
    seen = _record_proposals(proposer)
    result = decode(tiny_llama, proposer, inputs, max_new_tokens=9, cost=CostProfile.flat())
    assert result.tokens == reference[:9] and not result.cut_inside_path
    assert_drafted(result, min_accepted=4)
    for history_len, limits, tree in seen:
        assert limits.remaining == 9 - (history_len - len(inputs.prompt_ids))
        assert (tree.max_depth if len(tree) else 0) <= limits.remaining - 1


def test_a_stored_answer_is_drafted_to_its_eos_and_never_past_it(tiny_llama):
    """The stop tokens are known to the chooser: a stored answer that runs on past the
    request's EOS is drafted up to that EOS, accepted, and no node below it is drafted."""
    inputs, reference = _memory_case(tiny_llama)
    eos = reference[12]
    assert eos not in reference[:12]
    proposer = RecapProposer()
    proposer.store.add(list(reference))
    seen = _record_proposals(proposer)
    result = decode(tiny_llama, proposer, inputs, max_new_tokens=20, eos_token_ids=[eos], cost=PROFILE)
    assert result.tokens == reference[:13] and result.stop_reason == "eos"
    assert_drafted(result, min_accepted=10)
    for _, _, tree in seen:
        for node in range(len(tree)):
            assert eos not in tree.path_tokens(node)[:-1]  # nothing below an EOS node


def test_nodes_past_eos_teach_the_calibration_nothing():
    """A copy accepted through EOS, then rejected: the request ended at EOS, so the rejection
    after it is no miss; only the nodes up to the kept tokens are labelled."""
    from recap.core import VerifiedTree
    from recap.core.calibration import REQUEST
    from recap.core.chooser import Candidates, choose

    proposer = RecapProposer()
    probs, cells, _ = proposer.calibrator.continuation(REQUEST, 20, np.arange(1, 6))
    candidates = Candidates([], [], [], [], [])
    candidates.add_chain([5, 6, 7, 8, 9], probs, cells)
    tree, proposer.request.pending = choose(candidates, None, 0)
    rows = len(tree) + 1

    def verified(kept):
        return VerifiedTree(tree, np.zeros((rows, 1), np.int64), np.zeros((rows, 1), np.float32),
                            np.zeros(rows, np.int64), [0, 1, 2], kept=kept)

    proposer._learn(verified(None))  # depths 1-3 accepted, 4 rejected
    assert proposer.calibrator.trials.sum() == 4 and proposer.calibrator.accepts.sum() == 3
    proposer.calibrator.reset()
    proposer._learn(verified(2))  # EOS at depth 2: depths 3 and 4 lie past it
    assert proposer.calibrator.trials.sum() == 2 and proposer.calibrator.accepts.sum() == 2
