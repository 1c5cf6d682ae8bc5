"""Prefill on the fast kernels (`recap.verifier.kernels.prefix`): a prompt's K/V and Top-K rows
are those of one-token steps, bit for bit, whatever the chunk size and whether a shared
prefix was computed now or copied from an earlier prompt. A cache that hands over rows the
prompts do not share must be caught."""

from __future__ import annotations

import numpy as np
import pytest

from recap.core import DraftTree
from recap.images import synthetic_image
from recap.verifier.kernels import prefix as prefix_module
from recap.verifier.kernels.prefix import PrefixCache
from tests.conftest import CHUNKED_IMAGE_MODELS, TINY_MODELS, load_target

SYSTEM = "You are a careful assistant. Answer briefly and precisely, in plain words."


def _prompt(target, question: str):
    return target.prepare([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


def _prefilled(target, inputs):
    """(Top-K ids, Top-K logits, first token, K/V rows) of a prefill."""
    rows, first = target.prefill(inputs)
    length = target.past_len
    state = (rows.topk_ids.copy(), rows.topk_logits.copy(), first, target.lane.kv.keys[:, :, :length].copy(),
             target.lane.kv.values[:, :, :length].copy())
    target.release()
    return state


def _same(a, b) -> bool:
    return a[2] == b[2] and all(np.array_equal(x, y) for x, y in zip(a[:2] + a[3:], b[:2] + b[3:]))


@pytest.fixture
def fresh_cache():
    """Each test starts from an empty prefix cache on its target."""
    targets = []

    def use(target):
        target.prefix_cache = PrefixCache()
        targets.append(target)
        return target

    yield use
    for target in targets:
        target.prefix_cache = PrefixCache()


@pytest.mark.parametrize("name", TINY_MODELS)
def test_a_text_prefill_is_one_token_steps_bit_for_bit(name, fresh_cache):
    target = fresh_cache(load_target(name))
    inputs = _prompt(target, "What colour is the sky at noon?")
    ids = inputs.prompt_ids
    rows, first = target.prefill(inputs)
    prefilled_keys = target.lane.kv.keys[:, :, :len(ids)].copy()
    last_row = rows.topk_logits[-1].copy()
    target.release()
    target.prefix_cache = PrefixCache()
    target.prefill(type(inputs)(input_ids=inputs.input_ids[:, :1]))  # the first token alone, then steps
    for token in ids[1:]:
        step = target.verify(int(token), DraftTree.empty())
        target.commit([])
    assert target.past_len == len(ids) and np.array_equal(target.lane.kv.keys[:, :, :len(ids)], prefilled_keys)
    assert np.array_equal(step.topk_logits[0], last_row) and int(step.argmax[0]) == first
    target.release()


@pytest.mark.parametrize("name", TINY_MODELS)
def test_a_shared_prefix_copied_from_the_cache_gives_the_same_bits(name, fresh_cache, monkeypatch):
    target = fresh_cache(load_target(name))
    first, second = _prompt(target, "Name a large river."), _prompt(target, "Name a tall mountain.")
    target.prefix_cache.clear()
    alone = _prefilled(target, second)
    target.prefix_cache.clear()
    _prefilled(target, first)
    hits = target.prefix_cache.hits
    reused = _prefilled(target, second)
    assert target.prefix_cache.hits == hits + 1 and target.prefix_cache.reused_tokens > 10
    assert _same(reused, alone)
    monkeypatch.setattr(prefix_module, "PREFILL_CHUNK", 5)  # many chunks: the same bits again
    target.prefix_cache.clear()
    assert _same(_prefilled(target, second), alone)


def test_a_cache_that_hands_over_unshared_rows_is_caught(fresh_cache, monkeypatch):
    """Negative control: a lookup that claims one row more than the prompts share."""
    target = fresh_cache(load_target("tiny-llama"))
    first, second = _prompt(target, "Name a large river."), _prompt(target, "Name a tall mountain.")
    alone = _prefilled(target, second)
    target.prefix_cache.clear()
    _prefilled(target, first)
    honest = PrefixCache.lookup

    def lying(self, tokens, limit, scope="", **options):
        shared, entry = honest(self, tokens, limit, scope, **options)
        return (min(shared + 1, limit, len(entry.tokens)), entry) if entry is not None else (shared, entry)

    monkeypatch.setattr(PrefixCache, "lookup", lying)
    assert not _same(_prefilled(target, second), alone)


def test_the_prefix_cache_is_bounded_and_drops_the_least_recent(fresh_cache):
    target = fresh_cache(load_target("tiny-llama"))
    target.prefix_cache = cache = PrefixCache(max_tokens=100)
    for question in ("one?", "two?", "three?", "four?"):
        _prefilled(target, _prompt(target, question))
    assert 0 < cache.tokens <= 100




@pytest.mark.parametrize("name", CHUNKED_IMAGE_MODELS)
def test_an_image_prompt_prefills_in_chunks_as_one_token_steps_bit_for_bit(name, fresh_cache, monkeypatch):
    """The vision tower runs once (`encode_images`), then the language rows go through the fast
    step as chains: chunks of one row (one-token steps with the image's input vectors and
    M-RoPE coordinates), of five, or the whole prompt give the same bits."""
    target = fresh_cache(load_target(name))
    inputs = target.encode_images(target.prepare("What is in the picture?", synthetic_image(0, 64, 48)))
    assert inputs.language is not None and inputs.language.first_image_row < len(inputs.prompt_ids)
    if name == "tiny-qwen2.5-vl":  # image rows have three different coordinates
        assert inputs.language.positions.shape[1] == 3 and inputs.language.rope_offset != 0
    whole = _prefilled(target, inputs)
    for chunk in (1, 5):
        monkeypatch.setattr(prefix_module, "PREFILL_CHUNK", chunk)
        assert _same(_prefilled(target, inputs), whole)
    assert target.prefix_cache.tokens <= inputs.language.first_image_row


@pytest.mark.parametrize("name", CHUNKED_IMAGE_MODELS)
def test_two_images_after_the_same_text_share_only_the_text_rows(name, fresh_cache, monkeypatch):
    """Image placeholders are the same tokens for every image, so a cache keyed by tokens must
    stop at the first image row. Negative control: a prefill that shares past it must be caught."""
    target = fresh_cache(load_target(name))
    first = target.prepare("What is in the picture?", synthetic_image(1, 64, 48))
    second = target.prepare("What is in the picture?", synthetic_image(2, 64, 48))
    assert first.prompt_ids == second.prompt_ids
    alone = _prefilled(target, second)
    target.prefix_cache.clear()
    _prefilled(target, first)
    shared = _prefilled(target, second)
    assert 0 < target.prefix_cache.reused_tokens <= target.encode_images(second).language.first_image_row
    assert _same(shared, alone)
    original = prefix_module.ChunkedPrefill.__init__

    def unbounded(self, lane, prompt, rows_kept="all", language=None):
        original(self, lane, prompt, rows_kept, language)
        self._shareable = len(prompt)

    monkeypatch.setattr(prefix_module.ChunkedPrefill, "__init__", unbounded)
    target.prefix_cache.clear()
    _prefilled(target, first)
    assert not _same(_prefilled(target, second), alone)


def test_the_image_attention_capture_rides_on_the_chunked_prefill(fresh_cache):
    """SAM+ViSkip's gate (the last prompt row's attention on the image) is read from the fast
    step, so the capture never changes which path, and hence which bits, a prefill takes.
    It matches the stock capture's value closely (different kernels, so not bit for bit)."""
    fast = fresh_cache(load_target("tiny-qwen2.5-vl"))
    stock = load_target("tiny-qwen2.5-vl", kernels="stock")
    inputs = fast.prepare("What is in the picture?", synthetic_image(0, 64, 48))
    values = []
    for target in (fast, stock):
        assert target.capture_image_attention(True)
        try:
            rows, _ = target.prefill(inputs)
            target.release()
        finally:
            target.capture_image_attention(False)
        values.append(rows.image_attention)
    assert values[0] is not None and 0 < values[0] < 1
    assert values[0] == pytest.approx(values[1], rel=1e-3)


def test_prefixes_are_reused_only_within_their_scope(fresh_cache):
    """A server scopes the cache by tenant: one tenant's prompts never speed up another's."""
    target = fresh_cache(load_target("tiny-llama"))
    first, second = _prompt(target, "Name a large river."), _prompt(target, "Name a tall mountain.")
    lane = target.fork()
    lane.prefix_scope = "alice"
    _prefilled(lane, first)
    bob = target.fork()
    bob.prefix_scope = "bob"
    hits = target.prefix_cache.hits
    _prefilled(bob, second)
    assert target.prefix_cache.hits == hits
    _prefilled(lane, second)
    assert target.prefix_cache.hits == hits + 1


def test_requests_admitted_together_compute_their_shared_prefix_once(fresh_cache, monkeypatch):
    """A burst of prompts with one system prompt, admitted in one step: the cache is asked when
    a prompt's first chunk runs and every chunk publishes its rows, so the later prompts copy
    what the first computed (before: each looked up at admission, found nothing, and computed
    the shared rows again). Outputs stay those of each prompt alone."""
    from recap import generate
    from recap.batching import generate_batch

    target = fresh_cache(load_target("tiny-llama"))
    questions = ("Name a large river.", "Name a tall mountain.", "Name a deep lake.")
    messages = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in questions]
    alone = []
    for message in messages:
        target.prefix_cache.clear()
        alone.append(generate(target, message, method="pld", max_new_tokens=6).tokens)
    target.prefix_cache = cache = PrefixCache()
    computed = []
    absorb = prefix_module.ChunkedPrefill.absorb
    monkeypatch.setattr(prefix_module.ChunkedPrefill, "absorb",
                        lambda self, logits, *rest: computed.append(len(logits)) or absorb(self, logits, *rest))
    batched = generate_batch(target, messages, method="pld", max_new_tokens=6, max_batch=3, progress=False)
    assert [r.tokens for r in batched] == alone
    ids = [[int(t) for t in _prompt(target, q).prompt_ids] for q in questions]
    shared = min(next(i for i, (a, b) in enumerate(zip(ids[0], other)) if a != b) for other in ids[1:])
    assert shared > 10
    assert cache.reused_tokens >= 2 * min(shared, 32)  # at most a 32-row chunk was published when they looked
    assert sum(computed) == sum(map(len, ids)) - cache.reused_tokens
