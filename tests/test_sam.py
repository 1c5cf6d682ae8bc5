"""SAM and SAM+ViSkip: draft rule, gate, the target's image-attention capture, losslessness."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import recap
from recap.check import run_check
from recap.cli import main
from recap.core import DraftTree, PromptRows, VerifiedTree
from recap.prompts import check_prompts
from recap.proposers import SamProposer, SamViSkipProposer, make_proposer

from .conftest import load_target
from .helpers import ReferencePrimed, assert_drafted

IMAGE_TOKEN = 7


def _prompt(ids=(), image_attention: float | None = None, excluded=(IMAGE_TOKEN,)) -> PromptRows:
    ids = np.asarray(ids, dtype=np.int64)
    rows = np.zeros((len(ids), 8))
    return PromptRows(ids=ids, topk_ids=rows.astype(np.int64), topk_logits=rows.astype(np.float32),
                      eligible=np.ones(len(ids), dtype=bool), vocab_size=1000, excluded_tokens=frozenset(excluded),
                      image_attention=image_attention)


def _verified(image_attention: float | None) -> VerifiedTree:
    return VerifiedTree(tree=DraftTree.empty(), topk_ids=np.zeros((1, 8), dtype=np.int64),
                        topk_logits=np.zeros((1, 8), dtype=np.float32), argmax=np.zeros(1, dtype=np.int64),
                        accepted=[], image_attention=image_attention)


def _chain(tree: DraftTree) -> list[int]:
    assert tree.parents.tolist() == list(range(-1, len(tree) - 1)), "SAM drafts a single chain"
    return tree.tokens.tolist()


# ----------------------------------------------------------------------------- draft rule
def _history_with_match(length: int) -> tuple[list[int], list[int]]:
    """... X S C ... Y S: the longest earlier match of the end is S (X != Y), followed by C."""
    segment = list(range(100, 100 + length))
    continuation = list(range(300, 360))
    history = [10, 11, 12, 1] + segment + continuation + [20, 21, 2] + segment
    return history, continuation


@pytest.mark.parametrize("length", [1, 2, 3, 5, 8, 10, 11, 15])
def test_draft_follows_the_match_length(length):
    proposer = SamProposer()
    proposer.begin_request(_prompt())
    history, continuation = _history_with_match(length)
    expected = min(40, max(2, 4 * length))  # SAM-Decoding: alpha = 4; RECAP: lengths 2..40
    assert _chain(proposer.propose(history)) == continuation[:expected]


def test_draft_length_rule_and_options():
    proposer = SamProposer()
    assert [proposer.draft_length(n) for n in (1, 2, 9, 10, 11, 100)] == [4, 8, 36, 40, 40, 40]
    low = SamProposer(alpha=0.5)
    assert [low.draft_length(n) for n in (1, 4, 6, 80, 90)] == [2, 2, 3, 40, 40]
    short = SamProposer(min_match=3)
    short.begin_request(_prompt())
    assert len(short.propose(_history_with_match(2)[0])) == 0
    short.begin_request(_prompt())
    assert len(short.propose(_history_with_match(3)[0])) == 12
    with pytest.raises(ValueError):
        SamProposer(min_draft=5, max_draft=4)


def test_no_match_no_draft_and_excluded_tokens_cut_the_chain():
    proposer = SamProposer()
    proposer.begin_request(_prompt())
    assert len(proposer.propose(list(range(50)))) == 0
    proposer.begin_request(_prompt())
    history = [5, 6, 8, 9, IMAGE_TOKEN, 11, 12, 30, 5, 6]
    assert _chain(proposer.propose(history)) == [8, 9]
    proposer.begin_request(_prompt())
    assert len(proposer.propose([5, 6, IMAGE_TOKEN, 11, 5, 6])) == 0


def _brute_force_draft(history: list[int], excluded: set[int], rule) -> list[int]:
    """Longest suffix that also ends earlier, its earliest earlier end, the rule's length."""
    n = len(history)
    for length in range(n - 1, 0, -1):
        for end in range(length - 1, n - 1):
            if history[end - length + 1 : end + 1] == history[n - length :]:
                draft = []
                for token in history[end + 1 : end + 1 + rule(length)]:
                    if token in excluded:
                        break
                    draft.append(token)
                return draft
    return []


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=50), st.lists(st.integers(1, 6), min_size=1, max_size=12))
def test_incremental_proposals_match_brute_force(tokens, steps):
    """One request: the history grows by a few tokens per step, the automaton extends with them."""
    proposer = SamProposer(alpha=1.5)
    proposer.begin_request(_prompt(excluded=(4,)))
    size = 1
    for step in steps:
        history = tokens[:size]
        assert _chain(proposer.propose(history)) == _brute_force_draft(history, {4}, proposer.draft_length)
        if size >= len(tokens):
            break
        size += step


def test_requests_do_not_share_the_automaton():
    proposer = SamProposer()
    proposer.begin_request(_prompt())
    assert _chain(proposer.propose([1, 2, 3, 4, 1, 2])) == [3, 4, 1, 2]  # all there is after the match
    proposer.begin_request(_prompt())
    assert len(proposer.propose([9, 1, 2])) == 0


# ----------------------------------------------------------------------------- ViSkip gate
def test_viskip_gate_fires_at_and_above_the_threshold():
    history = _history_with_match(3)[0]
    proposer = SamViSkipProposer()
    assert proposer.wants_image_attention and proposer.threshold == 0.35 and proposer.max_draft == 40
    proposer.begin_request(_prompt(image_attention=0.36))       # prefill's value gates the first step
    assert len(proposer.propose(history)) == 0 and proposer.skipped_steps == 1
    proposer.observe(_verified(0.34))
    assert len(proposer.propose(history)) == 12 and proposer.skipped_steps == 1
    proposer.observe(_verified(0.35))
    assert len(proposer.propose(history)) == 0 and proposer.skipped_steps == 2
    proposer.observe(_verified(None))                           # no image: plain SAM
    assert len(proposer.propose(history)) == 12
    proposer.begin_request(_prompt(image_attention=0.2))
    assert len(proposer.propose(history)) == 12
    assert (proposer.skipped_steps, proposer.steps) == (2, 5)
    strict = SamViSkipProposer(threshold=0.5)
    strict.begin_request(_prompt(image_attention=0.45))
    assert len(strict.propose(history)) == 12 and strict.skipped_steps == 0


def test_registered():
    assert isinstance(make_proposer("sam"), SamProposer)
    assert isinstance(make_proposer("sam-viskip", threshold=0.5), SamViSkipProposer)
    assert not getattr(make_proposer("sam"), "wants_image_attention", False)


# ----------------------------------------------------------------------------- capture
def _image_inputs(target, count: int = 3):
    return [target.prepare(p, image) for p, image in check_prompts(count + 1, images=True) if image is not None]


def _eager_image_mass(target, ids: list[int], inputs) -> float:
    """Independent reference: a full eager forward (no cache, no tree) over ``ids`` with the
    request's image; last layer's attention weights of the last query, head mean, image sum."""
    model = target.model
    extra = dict(inputs.extra)
    grow = len(ids) - inputs.input_ids.shape[1]
    for name, fill in (("attention_mask", 1), ("mm_token_type_ids", 0)):
        if name in extra:
            extra[name] = torch.cat([extra[name], torch.full((1, grow), fill, dtype=extra[name].dtype)], dim=1)
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), **extra, output_attentions=True)
    finally:
        model.set_attn_implementation(before)
    image = torch.tensor(ids) == model.config.image_token_id
    return float(out.attentions[-1][0, :, -1, image].sum(-1).mean())


class _Recorder(SamViSkipProposer):
    """Never gates; drafts a small fixed-shape tree every step (so query 0 is not the only
    query and the tree mask matters); remembers each step's history (root last) and the
    value that came back."""

    def __init__(self):
        super().__init__(threshold=2.0)
        self.records: list[tuple[list[int], float | None]] = []
        self._pending: list[int] = []

    def begin_request(self, prompt):
        super().begin_request(prompt)
        self.records.append((prompt.ids.tolist(), prompt.image_attention))

    def propose(self, history, limits=None):
        self._pending = list(history)
        super().propose(history)
        tokens = [t for t in history[-6:] if t not in self.prompt.excluded_tokens][-3:]
        return DraftTree(tokens, [-1, -1, 0][: len(tokens)])

    def observe(self, step):
        super().observe(step)
        self.records.append((self._pending, step.image_attention))


@pytest.mark.parametrize("name", ["tiny-llava-next", "tiny-qwen2.5-vl"])
def test_captured_attention_equals_an_eager_computation(name):
    target = load_target(name)
    implementation = target.text_config._attn_implementation
    checked = 0
    for inputs in _image_inputs(target, 2):
        recorder = _Recorder()
        recap.decode(target, recorder, inputs, max_new_tokens=6)
        target.capture_image_attention(False)
        assert target.text_config._attn_implementation == implementation  # stock kernel again
        assert len(recorder.records) >= 3
        prompt_ids, prefill_value = recorder.records[0]
        assert prefill_value is not None and 0.0 < prefill_value < 1.0
        assert prefill_value == pytest.approx(_eager_image_mass(target, prompt_ids, inputs), abs=1e-4)
        for history, value in recorder.records[1:3]:  # roots of verifications (history ends at the root)
            assert value == pytest.approx(_eager_image_mass(target, history, inputs), abs=1e-4)
            checked += 1
    assert checked >= 4


def test_capture_is_none_without_image_tokens(tiny_target):
    enabled = tiny_target.capture_image_attention(True)
    try:
        assert enabled == tiny_target.accepts_images
        text = tiny_target.prepare("Count from one to ten in words.")
        recorder = _Recorder()
        recap.decode(tiny_target, recorder, text, max_new_tokens=5)
        assert len(recorder.records) >= 2 and all(value is None for _, value in recorder.records)
    finally:
        tiny_target.capture_image_attention(False)


@pytest.mark.parametrize("name", ["tiny-llava-next", "tiny-qwen2.5-vl"])
def test_capture_leaves_outputs_bit_identical(name):
    target = load_target(name)
    inputs = _image_inputs(target, 1)[0]
    tree = DraftTree([11, 12, 13, 14], [-1, 0, -1, 2])
    results = []
    for capture in (False, True, False):
        assert target.capture_image_attention(capture) == capture
        rows, first = target.prefill(inputs)
        step = target.verify(first, tree)
        target.release()
        results.append((rows, first, step))
        assert (rows.image_attention is not None, step.image_attention is not None) == (capture, capture)
    for rows, first, step in results[1:]:
        assert first == results[0][1]
        assert np.array_equal(rows.topk_logits, results[0][0].topk_logits)
        assert np.array_equal(step.topk_logits, results[0][2].topk_logits)
        assert np.array_equal(step.topk_ids, results[0][2].topk_ids)


# ----------------------------------------------------------------------------- end to end
class SeededSam(ReferencePrimed, SamProposer):
    """SAM reading prompt + reference first on every other request: long accepted chains."""


class SeededSamViSkip(ReferencePrimed, SamViSkipProposer):
    pass


@pytest.mark.parametrize("cls", [SeededSam, SeededSamViSkip])
def test_lossless_on_tiny_architectures(tiny_target, cls):
    proposer = cls()
    try:
        report = run_check(tiny_target, proposer, prompts=30, max_new_tokens=40, vary=True, seed=4)
        capturing = tiny_target.text_config._attn_implementation.startswith("recap-image-attention-")
    finally:
        tiny_target.capture_image_attention(False)
    failures = [(case.index, case.first_difference) for case in report.cases if not case.passed]
    assert not failures, f"mismatches (case, first differing token): {failures}"
    assert_drafted(report, min_accepted=50)
    assert report.tau > 1.5
    assert sum(case.cut_inside_path for case in report.cases) >= 2
    if cls is SeededSamViSkip:
        # The capture was on during the whole run, and the gate fired only where there was an image.
        assert capturing == tiny_target.accepts_images
        if tiny_target.accepts_images:
            assert 0 < proposer.skipped_steps < proposer.steps  # seeded tiny VLMs: 0.002-0.76 on the image
        else:
            assert proposer.skipped_steps == 0
    else:
        assert not capturing


def test_cli_notes_that_text_only_models_have_no_image(capsys):
    assert main(["generate", "--model", "tiny-llama", "--method", "sam-viskip", "--prompt", "hi",
                 "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert err.count("recap: note: tiny-llama has no image tokens; sam-viskip behaves as sam") == 1
    assert main(["generate", "--model", "tiny-llama", "--method", "sam", "--prompt", "hi",
                 "--max-new-tokens", "3"]) == 0
    assert "note" not in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sam", "sam-viskip"])
def test_lossless_on_smollm2(smollm2, method):
    report = run_check(smollm2, method, prompts=5, max_new_tokens=32, vary=True, seed=1)
    failures = [(case.index, case.first_difference) for case in report.cases if not case.passed]
    assert not failures, f"mismatches (case, first differing token): {failures}"
    assert_drafted(report)
