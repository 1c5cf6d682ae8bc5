"""Prefill computes the prompt's Top-K rows only for proposers that read them.

AR, PLD, SAM and lookahead never read `PromptRows.topk_ids`, so their prefill runs the LM
head on the last prompt row alone (as `model.generate` does with ``logits_to_keep=1``); RECAP
and token recycling seed from every row and get them all. Outputs stay those of decoding alone,
the head's picked rows are bit-identical to computing all rows, a row-less prefix-cache
entry never stands in for one with rows, and a head that leaves the picked rows where it
computed them is caught."""

from __future__ import annotations

import numpy as np
import pytest

from recap import generate
from recap.batching import generate_batch
from recap.decoding import decode
from recap.proposers import make_proposer
from recap.target.kernels import decoder as decoder_module
from recap.target.kernels.prefix import PrefixCache, chain
from tests.conftest import TINY_MODELS, load_target

QUESTIONS = ("Name a large river and say where it flows.", "Name a tall mountain.", "Name a deep lake, please.",
             "Count from one to five.")


def _head_rows_counted(target, monkeypatch) -> list[int]:
    """Rows each call of the fast decoder's LM head computes (padding included)."""
    calls: list[int] = []
    head = target._fast.head

    def counted(x, out, rows):
        calls.append(rows)
        return head(x, out, rows)

    monkeypatch.setattr(target._fast, "head", counted)
    return calls


@pytest.mark.parametrize("name", TINY_MODELS)
def test_ar_prefills_the_last_row_only_and_recap_every_row(name, monkeypatch):
    target = load_target(name)
    target.prefix_cache = PrefixCache()
    inputs = target.prepare(QUESTIONS[0])
    length = target.prompt_length(inputs)
    calls = _head_rows_counted(target, monkeypatch)
    ar = decode(target, make_proposer("ar"), inputs, max_new_tokens=1)
    ar_rows = sum(calls)
    seen = []
    recap = make_proposer("recap")
    begin = recap.begin_request
    monkeypatch.setattr(recap, "begin_request", lambda rows: seen.append(rows) or begin(rows))
    target.prefix_cache.clear()
    calls.clear()
    full = decode(target, recap, inputs, max_new_tokens=1)
    assert ar.tokens == full.tokens
    assert ar_rows <= 4 < length <= sum(calls)
    assert seen[0].topk_ids.shape == (length, target.top_k)


def test_the_choice_is_one_requests(monkeypatch):
    """A prefill after an AR request keeps its rows again unless told otherwise."""
    target = load_target("tiny-llama")
    target.prefix_cache = PrefixCache()
    inputs = target.prepare(QUESTIONS[1])
    decode(target, make_proposer("ar"), inputs, max_new_tokens=2)
    rows, _ = target.prefill(inputs)
    target.release()
    assert rows.topk_ids.shape[0] == target.prompt_length(inputs)
    assert not target.keep_prompt_rows(False)
    rows, _ = target.prefill(inputs)
    target.release()
    assert rows.topk_ids.shape == (0, target.top_k)


def test_the_stock_prefill_keeps_one_row_too():
    target = load_target("tiny-llama", kernels="stock")
    inputs = target.prepare(QUESTIONS[2])
    target.keep_prompt_rows(False)
    rows, first = target.prefill(inputs)
    target.release()
    assert rows.topk_ids.shape == (0, target.top_k)
    full, first_full = target.prefill(inputs)
    target.release()
    assert full.topk_ids.shape[0] == target.prompt_length(inputs) and first == first_full
    reference = target.reference_generate(inputs, 8)
    assert decode(target, make_proposer("sam"), inputs, max_new_tokens=8).tokens == reference


def test_the_head_on_picked_rows_gives_their_bits():
    """`FastDecoder.forward`'s ``logit_rows``: the picked rows' logits equal those of the head
    over every row, bit for bit (the kernel's rows are independent)."""
    target = load_target("tiny-llama")
    fast = target._fast
    tokens = np.array(target.prepare(QUESTIONS[3]).prompt_ids[:11], np.int64)
    starts, paths = chain(len(tokens))
    positions = np.arange(len(tokens), dtype=np.int64)
    cache = fast.new_cache(64)
    every = fast.forward(cache, tokens, positions, starts, paths).copy()
    for picked in ([10], [0, 4, 10], [3, 4, 5, 6, 7]):
        cache = fast.new_cache(64)
        logits = fast.forward(cache, tokens, positions, starts, paths, logit_rows=np.array(picked, np.int64))
        assert np.array_equal(logits[picked], every[picked])


def test_a_mixed_batch_gives_each_prompt_its_own_output():
    """Requests with and without prompt rows in one batch (prefill chunks riding beside other
    requests' trees): every answer is that of its prompt alone."""
    target = load_target("tiny-llama")
    methods = ("recap", "ar", "sam", "pld")
    target.prefix_cache = PrefixCache()
    alone = []
    for question, method in zip(QUESTIONS, methods):
        target.prefix_cache.clear()
        alone.append(generate(target, question, method=method, max_new_tokens=10).tokens)
    target.prefix_cache.clear()
    batched = generate_batch(target, list(QUESTIONS), proposers=[make_proposer(m) for m in methods],
                             max_new_tokens=10, max_batch=4, progress=False)
    assert [r.tokens for r in batched] == alone


def test_a_head_that_leaves_picked_rows_in_place_is_caught(monkeypatch):
    """Negative control: the head computed on the gathered rows but never moved back."""
    target = load_target("tiny-llama")
    target.prefix_cache = PrefixCache()
    inputs = target.prepare(QUESTIONS[0])
    right = decode(target, make_proposer("recap"), inputs, max_new_tokens=6).tokens
    target.prefix_cache.clear()
    target._fast._buffers.logits[:] = np.nan  # whatever a reused buffer holds: the picked rows overwrite it
    assert decode(target, make_proposer("ar"), inputs, max_new_tokens=6).tokens == right

    def unmoved(self, picked):
        b = self._buffers
        b.x[: len(picked)] = b.x[picked]
        self.head(b.x, b.logits, decoder_module.padded_rows(len(picked)))

    monkeypatch.setattr(decoder_module.FastDecoder, "_head_rows", unmoved)
    target.prefix_cache.clear()
    target._fast._buffers.logits[:] = np.nan
    assert decode(target, make_proposer("ar"), inputs, max_new_tokens=6).tokens != right


def test_a_row_less_cache_entry_never_stands_in_for_rows():
    """AR's prefill stores its K/V without Top-K rows: RECAP's prefill of the same prompt
    computes its rows (the same bits as a cold prefill); an entry with rows serves AR too, and
    AR's own entry does not replace it."""
    target = load_target("tiny-llama")
    target.prefix_cache = cache = PrefixCache()
    inputs = target.prepare(QUESTIONS[1])
    cold, _ = target.prefill(inputs)
    target.release()
    cache.clear()
    target.keep_prompt_rows(False)
    target.prefill(inputs)
    target.release()
    hits = cache.hits
    rows, _ = target.prefill(inputs)
    target.release()
    assert cache.hits == hits  # the row-less entry was not used
    assert np.array_equal(rows.topk_ids, cold.topk_ids) and np.array_equal(rows.topk_logits, cold.topk_logits)
    target.keep_prompt_rows(False)
    target.prefill(inputs)  # reuses the entry with rows, stores a row-less one beside it
    target.release()
    assert cache.hits == hits + 1
    rows, _ = target.prefill(inputs)
    target.release()
    assert cache.hits == hits + 2 and np.array_equal(rows.topk_logits, cold.topk_logits)
