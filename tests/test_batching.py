"""Continuous batching (`recap.batching`, `recap.verifier.batch`): a request's output, and on
the fast kernels its logits bit for bit, are what it gets decoded alone, whatever else is in
the batch: other lengths, images, requests that end, fail or are cancelled mid-batch. A
forward whose attention lets one request see another's KV cache must be caught. The shared
budget (`share_budget`) is checked against brute force."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import recap
from recap.batching import Batch, generate_batch
from recap.core import CostProfile, DraftTree
from recap.core.chooser import share_budget
from recap.decoding import Decoding, decode
from recap.errors import InputError
from recap.prompts import check_prompts
from recap.proposers import make_proposer
from recap.proposers.base import BaseProposer
from recap.proposers.testing import DecoyDrafter
from recap.verifier.batch import StepBatch, StepRequest, verify_batch
from recap.verifier.kernels.decoder import FastDecoder
from recap.verifier.sampling import Sampling
from tests.conftest import TINY_MODELS, fixed_cost_profile, load_target
from tests.helpers import assert_drafted


def _cases(target, count: int) -> list:
    """Prompts (with images where the model takes them) as model inputs, of different lengths."""
    return [target.prepare(prompt, image if target.accepts_images else None)
            for prompt, image in check_prompts(count, images=target.accepts_images)]


def _decoy(target, inputs, tokens, seed: int) -> DecoyDrafter:
    """A drafter that hides the request's true continuation among decoys."""
    return DecoyDrafter(inputs.prompt_ids + tokens, seed=seed, max_nodes=12)


def _run(batch: Batch) -> None:
    while len(batch):
        for event in batch.step():
            if event.error is not None:
                raise event.error


@pytest.mark.parametrize("name", TINY_MODELS)
def test_batched_requests_are_lossless_against_decoding_alone(name):
    """Requests of different lengths (images and text mixed on the VLMs), one of them cut
    short by its token limit, batched three at a time: every output equals plain decoding."""
    target = load_target(name)
    cases = _cases(target, 5)
    limits = [24, 6, 24, 16, 1]
    alone = [decode(target, make_proposer("ar"), inputs, max_new_tokens=n).tokens for inputs, n in zip(cases, limits)]
    batch = Batch(max_batch=3, cost=fixed_cost_profile())
    decodings = [Decoding(target.fork(), _decoy(target, inputs, tokens, seed), inputs, max_new_tokens=n)
                 for seed, (inputs, tokens, n) in enumerate(zip(cases, alone, limits))]
    for decoding in decodings:
        batch.add(decoding)
    _run(batch)
    assert [d.result.tokens for d in decodings] == alone
    assert max(batch.rows) > 12, "the steps never held more than one request's tree"
    assert_drafted([d.result for d in decodings], min_accepted=8)


def _tree(seed: int, size: int) -> DraftTree:
    rng = np.random.default_rng(seed)
    return DraftTree(rng.integers(0, 1000, size), [-1] + [int(rng.integers(-1, i)) for i in range(1, size)])


def _batched_logits(target, cases, trees) -> list[np.ndarray]:
    lanes = [target.fork() for _ in cases]
    roots = [lane.prefill(inputs)[1] for lane, inputs in zip(lanes, cases)]
    verify_batch(StepBatch([StepRequest(lane, root, tree, None, 1) for lane, root, tree in zip(lanes, roots, trees)]))
    logits = [lane.last_logits.copy() for lane in lanes]
    for lane in lanes:
        lane.release()
    return logits


@pytest.mark.parametrize(("name", "dtype"), [(name, "float32") for name in TINY_MODELS] + [("tiny-llama", "bfloat16")])
def test_a_batched_verify_gives_each_request_its_logits_bit_for_bit(name, dtype):
    """bfloat16 too. The 1-row request alone runs the spread 6x2 block, in the batch the 3x4
    block (on a 16-register CPU)."""
    target = load_target(name, dtype)
    cases = _cases(target, 3)
    trees = [_tree(0, 9), DraftTree.empty(), _tree(1, 17)]
    alone = []
    for inputs, tree in zip(cases, trees):
        _, root = target.prefill(inputs)
        target.verify(root, tree)
        alone.append(target.last_logits.copy())
        target.release()
    for got, want in zip(_batched_logits(target, cases, trees), alone):
        assert got.shape == want.shape and np.array_equal(got, want)


def test_attention_that_sees_another_requests_cache_is_caught(tiny_llama, monkeypatch):
    """Negative control: a forward that gives every request the first request's KV cache."""
    target = tiny_llama
    cases = _cases(target, 2)
    trees = [_tree(2, 6), _tree(3, 6)]
    honest = _batched_logits(target, cases, trees)
    forward = FastDecoder.forward_batch

    def leaky(self, caches, *args):
        shared = caches[0]
        shared.reserve(len(args[0]))
        return forward(self, [shared] * len(caches), *args)

    monkeypatch.setattr(FastDecoder, "forward_batch", leaky)
    leaked = _batched_logits(target, cases, trees)
    assert not np.array_equal(leaked[1], honest[1])


class _FailsAtStep(BaseProposer):
    """Proposes nothing, then raises at its ``fail_at``-th step."""

    def __init__(self, fail_at: int):
        self.fail_at, self.calls = fail_at, 0

    def propose(self, history, limits=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("drafter failed")
        return DraftTree.empty()


def test_a_failing_or_cancelled_request_leaves_the_others_exact(tiny_llama):
    target = tiny_llama
    cases = _cases(target, 4)
    alone = [decode(target, make_proposer("ar"), inputs, max_new_tokens=20).tokens for inputs in cases]
    batch = Batch(max_batch=4, cost=fixed_cost_profile(), prefills_per_step=4)
    proposers = [_decoy(target, cases[0], alone[0], 0), _FailsAtStep(3), _decoy(target, cases[2], alone[2], 2),
                 _decoy(target, cases[3], alone[3], 3)]
    decodings = [Decoding(target.fork(), p, inputs, max_new_tokens=20) for p, inputs in zip(proposers, cases)]
    for decoding in decodings:
        batch.add(decoding)
    errors = []
    steps = 0
    while len(batch):
        events = batch.step()
        errors += [e for e in events if e.error is not None]
        steps += 1
        if steps == 4:
            batch.cancel(decodings[3])
    assert [e.decoding for e in errors] == [decodings[1]] and "drafter failed" in str(errors[0].error)
    assert decodings[1].target.holds_cache is False and decodings[3].target.holds_cache is False
    assert decodings[0].result.tokens == alone[0] and decodings[2].result.tokens == alone[2]
    assert 1 < len(decodings[3].result.tokens) < 20 and decodings[3].result.tokens == alone[3][:len(
        decodings[3].result.tokens)]
    assert_drafted([decodings[0].result, decodings[2].result])


def test_a_request_that_ends_in_the_step_it_starts_reports_its_end_once():
    """Regression: on the stock kernels a prefill runs whole when its request is admitted, so
    its first token and its first verification come from one `Batch.step`. The first token's
    event must not say the request finished: `BatchEvent.finished` used to read the decoding
    when asked, after the whole step, and the server then ended the answer at its first token
    and dropped the verification's (seen when a stored answer was drafted whole)."""
    target = load_target("tiny-llama", kernels="stock")
    batch = Batch(max_batch=1, prefills_per_step=1)
    decoding = Decoding(target, make_proposer("ar"), target.prepare("Tell me about the sea."), max_new_tokens=2)
    batch.add(decoding)
    events = batch.step()
    assert [event.finished for event in events] == [False, True]
    assert [token for event in events for token in event.step.tokens] == decoding.result.tokens
    assert len(decoding.result.tokens) == 2


def test_seeded_sampling_in_a_batch_draws_what_it_draws_alone(tiny_llama):
    target = tiny_llama
    cases = _cases(target, 3)
    sampling = Sampling.of(0.9, None, 0.95, 7)
    alone = [decode(target, make_proposer("ar"), inputs, max_new_tokens=16, sampling=sampling).tokens
             for inputs in cases]
    batch = Batch(max_batch=3, cost=fixed_cost_profile())
    decodings = [Decoding(target.fork(), _decoy(target, inputs, tokens, i), inputs, max_new_tokens=16,
                          sampling=sampling) for i, (inputs, tokens) in enumerate(zip(cases, alone))]
    for decoding in decodings:
        batch.add(decoding)
    _run(batch)
    assert [d.result.tokens for d in decodings] == alone
    assert_drafted([d.result for d in decodings])


def test_generate_batch_with_recap_is_lossless_and_shares_the_budget(smollm2):
    """Real drafting on SmolLM2: the shared budget drafts, drafts are accepted, and every
    answer equals `recap.generate` of the prompt alone."""
    prompts = ["List the days of the week, one per line.", "Count from one to twelve in words.",
               "Write the alphabet in capital letters, separated by commas."]
    alone = [recap.generate(smollm2, p, method="ar", max_new_tokens=40).tokens for p in prompts]
    results = generate_batch(smollm2, prompts, method="recap", max_new_tokens=40, max_batch=3, progress=False)
    assert [r.tokens for r in results] == alone
    assert all(r.text for r in results)
    assert_drafted(results, min_accepted=10)


def test_generate_batch_on_stock_kernels_matches_model_generate():
    target = load_target("tiny-llama", kernels="stock")
    prompts = ["a b c", "the quick brown fox jumps over the lazy dog"]
    want = [target.stock_generate(target.prepare(p), 12) for p in prompts]
    results = generate_batch(target, prompts, method="ar", max_new_tokens=12, progress=False)
    assert [r.tokens for r in results] == want


def test_generate_batch_refuses_shared_proposers_and_mismatched_images(tiny_llama):
    proposer = make_proposer("recap")
    with pytest.raises(InputError, match="distinct proposer"):
        generate_batch(tiny_llama, ["a", "b"], proposers=[proposer, proposer], progress=False)
    with pytest.raises(InputError, match="images"):
        generate_batch(tiny_llama, ["a", "b"], images=[None], progress=False)


def test_requests_on_one_target_without_lanes_run_one_after_another(tiny_llama):
    """Two requests on the same target (no fork): the second waits for the first, both exact."""
    cases = _cases(tiny_llama, 2)
    want = [decode(tiny_llama, make_proposer("ar"), inputs, max_new_tokens=8).tokens for inputs in cases]
    batch = Batch(max_batch=4)
    decodings = [Decoding(tiny_llama, make_proposer("ar"), inputs, max_new_tokens=8) for inputs in cases]
    for decoding in decodings:
        batch.add(decoding)
    with pytest.raises(InputError, match="already"):
        batch.add(decodings[0])
    most_running = 0
    while len(batch):
        batch.step()
        most_running = max(most_running, len(batch.running))
    assert most_running == 1 and [d.result.tokens for d in decodings] == want


# ------------------------------------------------------------------ the shared budget
def _brute_force(gains, fixed, requests, cost, overhead=0.0, prefill=0):
    prompt_time = float(cost.predict(fixed)) - float(cost.predict(fixed - prefill)) if prefill else 0.0
    best, best_counts = -1.0, None
    for counts in itertools.product(*[range(len(g) + 1) for g in gains]):
        value = (requests + sum(float(np.sum(g[:c])) for g, c in zip(gains, counts))) / \
            (float(cost.predict(fixed + sum(counts))) - prompt_time + overhead)
        if value > best + 1e-12:
            best, best_counts = value, counts
    return best, best_counts


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(0.01, 0.99), max_size=4), min_size=1, max_size=3),
       st.floats(0.02, 0.6), st.integers(0, 3), st.sampled_from([0.0, 0.5, 3.0]), st.integers(0, 40))
def test_the_shared_budget_is_the_exact_optimum(raw, slope, extra_rows, overhead, prefill):
    gains = [np.sort(np.array(g))[::-1] for g in raw]  # each request's offer best first
    cost = CostProfile.linear(slope)
    requests = len(gains) + (1 if extra_rows else 0)
    fixed = requests + extra_rows + prefill
    counts = share_budget(gains, fixed, requests, cost, overhead=overhead, prefill_rows=prefill)
    prompt_time = float(cost.predict(fixed)) - float(cost.predict(fixed - prefill)) if prefill else 0.0
    value = (requests + sum(float(np.sum(g[:c])) for g, c in zip(gains, counts))) / \
        (float(cost.predict(fixed + sum(counts))) - prompt_time + overhead)
    best, _ = _brute_force(gains, fixed, requests, cost, overhead, prefill)
    assert value == pytest.approx(best, rel=1e-9)
    assert all(0 <= c <= len(g) for g, c in zip(gains, counts))


def test_the_shared_budget_takes_the_likelier_requests_nodes():
    cost = CostProfile.linear(0.3)
    sure, doubtful = np.array([0.95, 0.9, 0.85]), np.array([0.2, 0.1])
    assert share_budget([sure, doubtful], 2, 2, cost) == [3, 0]
    assert share_budget([sure, doubtful], 2, 2, None) == [3, 2]
    assert share_budget([sure, doubtful], 2, 2, cost, overhead=50.0) == [3, 2]  # a costly step: draft all


def test_prompt_rows_in_the_step_do_not_make_drafts_look_cheap():
    # A newcomer's 32 prompt rows ride in this step. Counted as step time, they would make
    # the doubtful nodes' rows look cheap next to the whole step (the old pricing drafted
    # them); they are paid once whatever is drafted, so the step drafts as it would without them.
    cost = CostProfile.linear(0.3)
    sure, doubtful = np.array([0.95, 0.9, 0.85]), np.array([0.2, 0.1])
    without = share_budget([sure, doubtful], 2, 2, cost)
    assert share_budget([sure, doubtful], 2 + 32, 2, cost, prefill_rows=32) == without == [3, 0]
    assert share_budget([sure, doubtful], 2 + 32, 2, cost) == [3, 1]  # priced as step time: the 0.2 node too
    with pytest.raises(ValueError):
        share_budget([sure], 2, 1, cost, prefill_rows=2)


# ------------------------------------------------------------------ one stream, overlapping requests
def _u_keys(proposer) -> set[int]:
    keys, _, _ = proposer.memory.unigram_arrays()
    return set(keys.tolist())


@pytest.mark.parametrize("shared", [True, False], ids=["fork", "fork on a private copy (negative control)"])
def test_a_request_overlapping_another_of_its_stream_teaches_the_stream(smollm2, monkeypatch, shared):
    """Two requests of one RECAP stream in one batch (the second on `fork_request`): the
    stream's token memory ends up holding the rows of both, as after running them in turn.
    Both seed U from every prompt row (``seed_prompt="all"``), so the forked request writes
    seeding rows as well as the rows of its verified trees (which differ from the sequential
    run's where the shared budget sized them otherwise) into the U it shares with the stream."""
    prompts = ["Name three rivers of Africa.", "Write four words that rhyme with cat."]
    cases = [smollm2.prepare(p) for p in prompts]
    sequential = make_proposer("recap", seed_prompt="all")
    for inputs in cases:
        decode(smollm2.fork(), sequential, inputs, max_new_tokens=12)
    if not shared:  # a fork that learns on a copy of the stream, as `BaseProposer.fork_request` does
        monkeypatch.setattr(type(sequential), "fork_request", lambda self: copy.deepcopy(self))
    stream = make_proposer("recap", seed_prompt="all")
    decode(smollm2, stream, smollm2.prepare("Say hello."), max_new_tokens=2)  # the stream exists
    seen_before = _u_keys(stream)
    batch = Batch(max_batch=2, cost=fixed_cost_profile(), prefills_per_step=2)
    decodings = [Decoding(smollm2.fork(), stream, cases[0], max_new_tokens=12),
                 Decoding(smollm2.fork(), stream.fork_request(), cases[1], max_new_tokens=12)]
    for decoding in decodings:
        batch.add(decoding)
    _run(batch)
    assert batch.peak_running == 2
    learned = _u_keys(sequential) - seen_before
    missing = learned - _u_keys(stream)
    if shared:
        assert not missing
    else:
        assert missing, "the negative control lost nothing: the test cannot tell"


@pytest.mark.parametrize("name", TINY_MODELS)
def test_newcomers_prefill_in_chunks_beside_running_requests_losslessly(name):
    """A small prefill budget (3 rows a step): prompts are prefilled over several steps while
    other requests decode in the same forwards (image prompts prefill whole); every output
    equals decoding alone."""
    target = load_target(name)
    target.prefix_cache.clear()
    cases = _cases(target, 4)
    alone = [decode(target, make_proposer("ar"), inputs, max_new_tokens=12).tokens for inputs in cases]
    target.prefix_cache.clear()
    batch = Batch(max_batch=4, cost=fixed_cost_profile(), prefill_rows=3)
    decodings = [Decoding(target.fork(), _decoy(target, inputs, tokens, i), inputs, max_new_tokens=12)
                 for i, (inputs, tokens) in enumerate(zip(cases, alone))]
    for decoding in decodings[:2]:
        batch.add(decoding)
    overlapped = 0
    steps = 0
    while len(batch):
        batch.step()
        steps += 1
        if steps == 2:
            for decoding in decodings[2:]:
                batch.add(decoding)
        overlapped += bool(batch.prefilling and batch.running)
    assert [d.result.tokens for d in decodings] == alone
    text_prompts = [inputs for inputs in cases if not inputs.has_image]
    if text_prompts:
        assert overlapped, "no prefill chunk ever ran beside a decoding request"
    assert_drafted([d.result for d in decodings])
