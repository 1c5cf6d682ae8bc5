"""Prefill computes the prompt's Top-K rows only where a proposer reads them.

AR, PLD, SAM, lookahead and token recycling never read `PromptRows.topk_ids` (``none``), so
their prefill runs the LM head on the last prompt row alone (as `model.generate` does with
``logits_to_keep=1``); RECAP and tree recycling read each eligible token's first row
(``first``), so image placeholders, special tokens and repeats get no head. Outputs stay
those of decoding alone, the computed rows are bit-identical to computing all rows (fast
kernels), RECAP's seeded memory is the same as from every row, a proposer reading a row it
did not ask for is stopped, a prefix-cache entry never stands in for more rows than it has,
and a head that leaves the picked rows where it computed them is caught."""

from __future__ import annotations

import numpy as np
import pytest

from recap import generate
from recap.batching import generate_batch
from recap.core import NOT_COMPUTED, first_eligible
from recap.decoding import decode, reference_generate
from recap.images import synthetic_image
from recap.proposers import make_proposer
from recap.verifier import prompt_rows as prompt_rows_module
from recap.verifier.kernels import decoder as decoder_module
from recap.verifier.kernels.prefix import PREFILL_CHUNK, PrefixCache, chain
from tests.conftest import CHUNKED_IMAGE_MODELS, TINY_MODELS, TINY_VISION_MODELS, load_target

QUESTIONS = ("Name a large river and say where it flows, the river and the sea.", "Name a tall mountain.",
             "Name a deep lake, please.", "Count from one to five.")


def _head_rows_counted(target, monkeypatch) -> list[int]:
    """Rows each call of the fast decoder's LM head is asked for (the kernel pads them itself)."""
    calls: list[int] = []
    head = target.decoder.head

    def counted(x, out, rows):
        calls.append(rows)
        return head(x, out, rows)

    monkeypatch.setattr(target.decoder, "head", counted)
    return calls


def _image_inputs(target, question: str):
    return target.prepare(question, synthetic_image(0, 40, 40) if target.accepts_images else None)


def _prefill(target, inputs, rows: str):
    if target.prefix_cache is not None:  # the fast kernels' (the stock path reuses no prefix)
        target.prefix_cache.clear()
    target.keep_prompt_rows(rows)
    prompt, first = target.prefill(inputs)
    target.release()
    return prompt, first


@pytest.mark.parametrize("name", [name for name in TINY_MODELS if name not in TINY_VISION_MODELS or
                                  name in CHUNKED_IMAGE_MODELS])
def test_each_method_prefills_the_rows_it_reads(name, monkeypatch):
    """AR: the last row; RECAP seeding from every first row (``seed_prompt="all"``, as
    recap-paper does): each eligible token's first row and the last, the others marked not
    computed; the head runs on those rows only; both give one first token. (A Gemma 3 image
    prompt prefills on transformers' forward, which computes every row's logits.)"""
    target = load_target(name)
    target.prefix_cache = PrefixCache()
    inputs = _image_inputs(target, QUESTIONS[0])
    length = target.prompt_length(inputs)
    calls = _head_rows_counted(target, monkeypatch)
    ar = decode(target, make_proposer("ar"), inputs, max_new_tokens=1)
    ar_rows = sum(calls)
    seen = []
    recap = make_proposer("recap", seed_prompt="all")
    begin = recap.begin_request
    monkeypatch.setattr(recap, "begin_request", lambda rows: seen.append(rows) or begin(rows))
    target.prefix_cache.clear()
    calls.clear()
    full = decode(target, recap, inputs, max_new_tokens=1)
    assert ar.tokens == full.tokens
    prompt = seen[0]
    wanted = np.union1d(first_eligible(prompt.ids, prompt.eligible), [length - 1])
    assert ar_rows == 1 and len(wanted) < length  # the chat template repeats tokens
    chunks = [np.count_nonzero((wanted >= start) & (wanted < start + PREFILL_CHUNK))
              for start in range(0, length, PREFILL_CHUNK)]
    assert sum(calls) == sum(chunks)  # each chunk's picked rows, no other
    computed = prompt.topk_ids[:, 0] != NOT_COMPUTED
    assert prompt.topk_ids.shape == (length, target.top_k) and np.array_equal(np.flatnonzero(computed), wanted)
    assert np.all(prompt.topk_logits[~computed] == -np.inf)
    every, first = _prefill(target, inputs, "all")
    assert first == full.tokens[0] and (every.topk_ids[:, 0] != NOT_COMPUTED).all()


@pytest.mark.parametrize("kernels", ["fast", "stock"])
def test_first_rows_are_those_of_every_row(kernels):
    """The rows a ``first`` prefill computes: bit-identical to an ``all`` prefill's on the
    fast kernels (the head's rows are independent); on stock, transformers' head over fewer
    rows may round differently, so the same Top-K ids and logits within float tolerance."""
    target = load_target("tiny-llama", kernels=kernels)
    inputs = target.prepare(QUESTIONS[0])
    every, first_all = _prefill(target, inputs, "all")
    some, first_some = _prefill(target, inputs, "first")
    none, first_none = _prefill(target, inputs, "none")
    assert first_all == first_some == first_none and none.topk_ids.shape == (0, target.top_k)
    rows = np.flatnonzero(some.topk_ids[:, 0] != NOT_COMPUTED)
    assert 0 < len(rows) < len(every.ids)
    if kernels == "fast":
        assert np.array_equal(some.topk_ids[rows], every.topk_ids[rows])
        assert np.array_equal(some.topk_logits[rows], every.topk_logits[rows])
    else:
        assert np.array_equal(some.topk_ids[rows, 0], every.topk_ids[rows, 0])
        assert np.allclose(some.topk_logits[rows], every.topk_logits[rows], atol=1e-4)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_recap_seeds_the_same_memory_from_its_rows(name):
    """RECAP's token memory after seeding from a ``first`` prefill equals the one from every
    row (the rows it reads are the rows computed); its outputs stay those of AR, with drafts
    accepted."""
    target = load_target(name)
    target.prefix_cache = PrefixCache()
    inputs = _image_inputs(target, QUESTIONS[0])
    memories = []
    for rows in ("all", "first"):
        prompt, _ = _prefill(target, inputs, rows)
        recap = make_proposer("recap", seed_prompt="all")
        recap.begin_request(prompt)
        memories.append(recap.memory.table("unigram"))
        recap.end_request()
    assert memories[0] and memories[0] == memories[1]
    target.prefix_cache.clear()
    reference = decode(target, make_proposer("ar"), inputs, max_new_tokens=24)
    target.prefix_cache.clear()
    stream = make_proposer("recap", seed_prompt="all")
    decode(target, stream, inputs, max_new_tokens=24)  # the stream learns the answer
    target.prefix_cache.clear()
    again = decode(target, stream, inputs, max_new_tokens=24)
    assert again.tokens == reference.tokens and sum(it.accepted for it in again.iterations) > 0


@pytest.mark.parametrize("name", TINY_MODELS)
def test_recap_without_prompt_seeding_prefills_one_head_row(name, monkeypatch):
    """``--ablation no-prompt-seed``: the prefill runs the head on its last row alone and U
    starts empty on a cold stream; the stream still learns from verified rows (the repeated
    request gets drafts accepted) and every output is AR's."""
    target = load_target(name)
    target.prefix_cache = PrefixCache()
    inputs = _image_inputs(target, QUESTIONS[0])
    reference = decode(target, make_proposer("ar"), inputs, max_new_tokens=24)
    stream = make_proposer("recap", ablation="no-prompt-seed")
    assert stream.rows_wanted == "none" and make_proposer("recap").rows_wanted == "answers"
    seen = []
    begin = stream.begin_request
    monkeypatch.setattr(stream, "begin_request",
                        lambda rows: seen.append(begin(rows) or stream.memory.counts()[0]))
    calls = _head_rows_counted(target, monkeypatch)
    target.prefix_cache.clear()
    first = decode(target, stream, inputs, max_new_tokens=24)
    assert calls[0] == 1 and seen == [0]  # one head row at prefill, nothing seeded
    target.prefix_cache.clear()
    again = decode(target, stream, inputs, max_new_tokens=24)
    assert first.tokens == again.tokens == reference.tokens
    assert seen[1] > 0 and sum(it.accepted for it in again.iterations) > 0


REPEAT_CHAT = [{"role": "user", "content": "Name three colours of the rainbow."},
               {"role": "assistant", "content": "Red, orange and yellow are three colours of the rainbow."},
               {"role": "user", "content": "Say that again, word for word."}]


@pytest.mark.parametrize("name", TINY_MODELS)
def test_the_answer_mask_finds_earlier_assistant_turns(name):
    """Every family's chat template opens an assistant turn with a header the target finds
    (checked on its probe), and the mask holds exactly the earlier answer's tokens; a first
    turn has none."""
    target = load_target(name)
    assert target.answer_header and target.tokenizer.decode(list(target.answer_header)).endswith("assistant\n")
    ids = np.array(target.prepare(REPEAT_CHAT).prompt_ids)
    mask = target.answer_mask(ids)
    assert target.tokenizer.decode(ids[mask].tolist()) == REPEAT_CHAT[1]["content"]
    assert not target.answer_mask(np.array(target.prepare(QUESTIONS[0]).prompt_ids)).any()
    wanted = target.wanted_positions(ids, "answers")
    firsts = target.wanted_positions(ids, "first")
    assert set(wanted) <= set(firsts) and wanted[-1] == len(ids) - 1
    assert np.all(mask[wanted[:-1]]) and len(wanted) > 1


def test_a_template_without_a_found_header_seeds_nothing(monkeypatch):
    """Where the probe fails (here: the header is forced empty) no row counts as an earlier
    answer: ``answers`` then computes the last row alone, and RECAP seeds nothing."""
    target = load_target("tiny-llama")
    target.prefix_cache = PrefixCache()
    monkeypatch.setitem(target.__dict__, "answer_header", ())
    inputs = target.prepare(REPEAT_CHAT)
    assert list(target.wanted_positions(np.array(inputs.prompt_ids), "answers")) == [target.prompt_length(inputs) - 1]
    recap = make_proposer("recap")
    seeded = []
    begin = recap.begin_request
    monkeypatch.setattr(recap, "begin_request", lambda rows: seeded.append(begin(rows) or recap.memory.counts()[0]))
    reference = decode(target, make_proposer("ar"), inputs, max_new_tokens=8).tokens
    target.prefix_cache.clear()
    first = decode(target, recap, inputs, max_new_tokens=8)
    target.prefix_cache.clear()
    again = decode(target, recap, inputs, max_new_tokens=8)  # the stream has learned the answer
    assert seeded[0] == 0 and first.tokens == again.tokens == reference
    assert sum(it.accepted for it in again.iterations) > 0


@pytest.mark.parametrize("name", TINY_MODELS)
def test_recap_seeds_from_the_earlier_answer_only(name, monkeypatch):
    """RECAP's default (``seed_prompt="answers"``): the prefill computes the first rows inside
    the earlier answer (and the last row); U holds exactly those tokens after seeding, none
    from the user's text; outputs are AR's, with drafts accepted once the stream has seen
    the request (a random tiny model does not repeat the answer it is asked to)."""
    target = load_target(name)
    target.prefix_cache = PrefixCache()
    inputs = target.prepare(REPEAT_CHAT)
    ids = np.array(inputs.prompt_ids)
    reference = decode(target, make_proposer("ar"), inputs, max_new_tokens=16)
    recap = make_proposer("recap")
    seeded = []
    begin = recap.begin_request
    monkeypatch.setattr(recap, "begin_request",
                        lambda rows: seeded.append(begin(rows) or set(recap.memory.table("unigram"))))
    calls = _head_rows_counted(target, monkeypatch)
    target.prefix_cache.clear()
    result = decode(target, recap, inputs, max_new_tokens=16)
    wanted = target.wanted_positions(ids, "answers")
    assert calls[0] == len(wanted)  # one prefill chunk: the answer's first rows and the last
    assert seeded[0] == {(int(ids[p]),) for p in wanted[:-1]}  # the last row (the header) is not seeded
    target.prefix_cache.clear()
    again = decode(target, recap, inputs, max_new_tokens=16)
    assert result.tokens == again.tokens == reference.tokens and sum(it.accepted for it in again.iterations) > 0


def test_answers_rows_sit_between_none_and_first_in_the_prefix_cache():
    from recap.verifier.kernels.prefix import _covers

    assert _covers("first", "answers") and _covers("answers", "none") and _covers("all", "answers")
    assert not _covers("answers", "first") and not _covers("none", "answers")


def test_a_prefill_that_computes_other_rows_is_caught(monkeypatch):
    """Negative control: a target that computes each token's last occurrence instead of its
    first leaves RECAP's (and tree recycling's) rows uncomputed: seeding refuses them."""
    target = load_target("tiny-llama")
    target.prefix_cache = PrefixCache()
    inputs = target.prepare(QUESTIONS[0])

    def last_eligible(ids, eligible):
        reversed_first = first_eligible(np.asarray(ids)[::-1], np.asarray(eligible)[::-1])
        return np.sort(len(ids) - 1 - reversed_first)

    monkeypatch.setattr(prompt_rows_module, "first_eligible", last_eligible)
    prompt, _ = _prefill(target, inputs, "first")
    for method in ("recap-paper", "tree-recycling"):
        with pytest.raises(ValueError, match="not computed"):
            make_proposer(method).begin_request(prompt)


def test_the_choice_is_one_requests():
    """A prefill after an AR request keeps all its rows again unless told otherwise."""
    target = load_target("tiny-llama")
    target.prefix_cache = PrefixCache()
    inputs = target.prepare(QUESTIONS[1])
    decode(target, make_proposer("ar"), inputs, max_new_tokens=2)
    rows, _ = target.prefill(inputs)
    target.release()
    assert (rows.topk_ids[:, 0] != NOT_COMPUTED).all() and len(rows.topk_ids) == target.prompt_length(inputs)
    assert target.keep_prompt_rows("none") == "none"
    rows, _ = target.prefill(inputs)
    target.release()
    assert rows.topk_ids.shape == (0, target.top_k)
    with pytest.raises(ValueError, match="prompt rows"):
        target.keep_prompt_rows(True)


def test_the_stock_prefill_keeps_one_row_too():
    target = load_target("tiny-llama", kernels="stock")
    inputs = target.prepare(QUESTIONS[2])
    target.keep_prompt_rows("none")
    rows, first = target.prefill(inputs)
    target.release()
    assert rows.topk_ids.shape == (0, target.top_k)
    full, first_full = target.prefill(inputs)
    target.release()
    assert full.topk_ids.shape[0] == target.prompt_length(inputs) and first == first_full
    reference = reference_generate(target, inputs, 8)
    assert decode(target, make_proposer("sam"), inputs, max_new_tokens=8).tokens == reference
    assert decode(target, make_proposer("recap"), inputs, max_new_tokens=8).tokens == reference


def test_the_head_on_picked_rows_gives_their_bits():
    """`FastDecoder.forward`'s ``logit_rows``: the picked rows' logits equal those of the head
    over every row, bit for bit (the kernel's rows are independent)."""
    target = load_target("tiny-llama")
    fast = target.decoder
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
    target.decoder._buffers.logits[:] = np.nan  # whatever a reused buffer holds: the picked rows overwrite it
    assert decode(target, make_proposer("ar"), inputs, max_new_tokens=6).tokens == right

    def unmoved(self, picked):
        b = self._buffers
        b.x[: len(picked)] = b.x[picked]
        self.head(b.x, b.logits, len(picked))

    monkeypatch.setattr(decoder_module.FastDecoder, "_head_rows", unmoved)
    target.prefix_cache.clear()
    target.decoder._buffers.logits[:] = np.nan
    assert decode(target, make_proposer("ar"), inputs, max_new_tokens=6).tokens != right


def test_a_cache_entry_serves_only_the_rows_it_has():
    """A prefix-cache entry serves a prefill up to the first row that prefill reads and the
    entry did not compute (none < first < all), with the same bits as a cold prefill, and a
    store with fewer rows never replaces an entry with more."""
    target = load_target("tiny-llama")
    target.prefix_cache = cache = PrefixCache()
    inputs = target.prepare(QUESTIONS[1])
    cold = {rows: _prefill(target, inputs, rows)[0] for rows in ("all", "first", "none")}
    length = target.prompt_length(inputs)

    def prefill(rows: str) -> tuple[int, object]:
        reused = cache.reused_tokens
        target.keep_prompt_rows(rows)
        prompt, _ = target.prefill(inputs)
        target.release()
        return cache.reused_tokens - reused, prompt

    def computed(rows: str) -> np.ndarray:
        return np.zeros(length, bool) if rows == "none" else cold[rows].topk_ids[:, 0] != NOT_COMPUTED

    for held in ("none", "first", "all"):
        for asked in ("none", "first", "all"):
            cache.clear()
            prefill(held)
            reused, prompt = prefill(asked)
            lacking = np.flatnonzero(computed(asked)[:length - 1] & ~computed(held)[:length - 1])
            assert reused == (lacking[0] if len(lacking) else length - 1), (held, asked)
            if asked == "none":
                assert prompt.topk_ids.shape == (0, target.top_k)
                continue
            wanted = computed(asked)
            assert np.array_equal(prompt.topk_ids[wanted], cold[asked].topk_ids[wanted])
            assert np.array_equal(prompt.topk_logits[wanted], cold[asked].topk_logits[wanted])
    cache.clear()
    prefill("all")
    prefill("none")  # reuses the entry with rows, stores a row-less one beside it
    prefill("first")
    assert prefill("all")[0] == length - 1  # the entry with every row is still there


def test_an_entry_missing_a_row_its_label_promises_is_not_trusted(monkeypatch):
    """An entry labelled ``first`` that lacks a first row (its arrays say so) serves only the
    rows before it: the prefill computes the rest, and seeding finds every row it reads with
    a cold prefill's bits. Negative control: a lookup that trusts the label serves the entry
    whole, the row stays missing, and seeding refuses it."""
    target = load_target("tiny-llama")
    target.prefix_cache = cache = PrefixCache()
    inputs = target.prepare(QUESTIONS[1])
    cold, _ = _prefill(target, inputs, "first")
    hole = int(np.flatnonzero(cold.topk_ids[:, 0] != NOT_COMPUTED)[1])

    def holed_prefill() -> tuple[int, object]:
        (entry,) = cache._entries.values()
        assert entry.rows == "first" and entry.topk_ids[hole, 0] != NOT_COMPUTED
        entry.topk_ids[hole], entry.topk_logits[hole] = NOT_COMPUTED, -np.inf
        reused = cache.reused_tokens
        target.keep_prompt_rows("first")
        prompt, _ = target.prefill(inputs)
        target.release()
        return cache.reused_tokens - reused, prompt

    reused, served = holed_prefill()
    assert reused == hole
    assert np.array_equal(served.topk_ids, cold.topk_ids) and np.array_equal(served.topk_logits, cold.topk_logits)
    make_proposer("tree-recycling").begin_request(served)

    lookup = PrefixCache.lookup
    monkeypatch.setattr(PrefixCache, "lookup", lambda self, tokens, limit, scope="", wanted=None:
                        lookup(self, tokens, limit, scope))
    reused, trusted = holed_prefill()
    assert reused == target.prompt_length(inputs) - 1 and trusted.topk_ids[hole, 0] == NOT_COMPUTED
    with pytest.raises(ValueError, match="not computed"):
        make_proposer("tree-recycling").begin_request(trusted)
