"""Correctness under faults and over a server's life (issue 21): streamed text for tokenizers
that rewrite, memory files that load but cannot be installed, concurrent saves, a proposer
that fails to end its request, bounded growth per tenant, and `custom_generate`'s
``max_time`` and cost-profile measurement.

Most tests run on `recap.overhead.SyntheticTarget` (a deterministic stand-in for the model)
with a tokenizer built here, so they need no model and take milliseconds.
"""

from __future__ import annotations

import gc
import logging
import re
import threading
import types
import warnings
import weakref
from collections.abc import Sequence

import numpy as np
import pytest

import recap
from recap.core.chooser import ChosenSizes
from recap.core.fast import FastMemory
from recap.core.persistence import MemoryFileError, read_token_memory, save_token_memory
from recap.decoding import decode
from recap.overhead import SyntheticTarget
from recap.proposers import make_proposer
from recap.proposers.base import AutoregressiveProposer
from recap.proposers.recap import RecapProposer
from recap.serve.engine import Engine, IncrementalDetokenizer, Job
from recap.serve.tenants import TenantStreams

VOCAB = 512
SPECIAL = 0


class PieceTokenizer:
    """A tokenizer over byte pieces: token ``t`` is ``pieces[t]``; decoding joins the bytes
    (UTF-8, a character whose bytes are incomplete becomes U+FFFD) and then applies
    ``rewrite``, which may change text that earlier tokens produced (merges, space clean-up).
    Counts the tokens it decodes, to check the detokenizer's work per step."""

    def __init__(self, pieces: Sequence[bytes], rewrite=None):
        self.pieces = list(pieces)
        self.rewrite = rewrite
        self.decoded_tokens = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        self.decoded_tokens += len(ids)
        data = b"".join(self.pieces[t] for t in ids if not (skip_special_tokens and t == SPECIAL))
        text = data.decode("utf-8", errors="replace")
        return self.rewrite(text) if self.rewrite is not None else text


def _pieces(seed: int = 0) -> list[bytes]:
    """Letters, words with and without spaces, punctuation with a leading or trailing space,
    and the two bytes of 'é' and the four of an emoji as separate tokens."""
    rng = np.random.default_rng(seed)
    alphabet = [b"a", b"b", b"ab", b" a", b"b ", b" ", b".", b" .", b", ", b"n't", b" n't", b"'s", b"\n",
                b"\xc3", b"\xa9", b"\xf0\x9f", b"\x98", b"\x80", "日本".encode(), "é".encode()]
    pieces = [b"<s>"]
    for _ in range(1, VOCAB):
        pieces.append(b"".join(alphabet[i] for i in rng.integers(0, len(alphabet), int(rng.integers(1, 3)))))
    return pieces


def merging(text: str) -> str:
    """'ab' reads 'X' (a merge that rewrites an 'a' sent before the 'b' arrived), and
    transformers' clean-up of spaces before punctuation and contractions."""
    text = text.replace("ab", "X")
    return re.sub(r" (?=[.,!?]|n't|'s)", "", text)


def _target(tokenizer: PieceTokenizer | None = None, seed: int = 0) -> SyntheticTarget:
    target = SyntheticTarget(VOCAB, seed=seed)
    target.tokenizer = tokenizer if tokenizer is not None else PieceTokenizer(_pieces())
    return target


def _run(engine: Engine, tenant: str, prompt: Sequence[int], max_tokens: int) -> tuple[list[dict], dict]:
    """Submit one job and wait for it: (its text events, its final event)."""
    events: list[dict] = []
    finished = threading.Event()

    def emit(event: dict) -> None:
        events.append(event)
        if event["type"] in ("done", "error"):
            finished.set()

    engine.submit(Job(tenant=tenant, inputs=list(prompt), max_tokens=max_tokens, emit=emit))
    assert finished.wait(120), "the job did not finish"
    return [e for e in events if e["type"] == "text"], events[-1]


# ----------------------------------------------------------------------------- streamed text
@pytest.mark.parametrize("rewrite", [None, merging], ids=["plain", "rewriting"])
def test_the_streamed_answer_is_the_answer_whatever_the_tokenizer(rewrite):
    tokenizer = PieceTokenizer(_pieces(), rewrite)
    target = _target(tokenizer)
    engine = Engine(target, TenantStreams("recap-paper", VOCAB))
    rewritten = 0
    try:
        for seed in range(6):
            prompt = target.sample_prompt(48, seed=seed)
            texts, done = _run(engine, "default", prompt, 80)
            assert done["type"] == "done"
            streamed = "".join(e["text"] for e in texts)
            assert streamed == done["text"]
            tokens = target.greedy(prompt, 80)
            if rewrite is None:  # a tokenizer that never rewrites: exactly the whole decode
                assert done["text"] == tokenizer.decode(tokens, skip_special_tokens=True)
            elif streamed != tokenizer.decode(tokens, skip_special_tokens=True):
                rewritten += 1
            for event in texts:
                assert event["text"].startswith(event["drafted_text"])
            assert not any(e["text"].endswith("\ufffd") for e in texts[:-1])  # half characters wait
    finally:
        engine.shutdown(5)
    if rewrite is not None:
        assert rewritten, "the rewriting tokenizer never rewrote sent text: the test would prove nothing"


def test_drafted_text_is_the_text_of_the_accepted_drafts():
    """One character per token: each delta's drafted part is exactly its drafted tokens."""
    letters = [b"<s>"] + [bytes([97 + i % 26]) for i in range(1, VOCAB)]
    target = _target(PieceTokenizer(letters))
    engine = Engine(target, TenantStreams("recap-paper", VOCAB))
    try:
        prompt = target.sample_prompt(64, seed=3)
        _run(engine, "default", prompt, 60)  # the stream learns the continuation
        texts, done = _run(engine, "default", prompt, 60)
    finally:
        engine.shutdown(5)
    assert done["recap"]["accepted_tokens"] > 0
    for event in texts:
        if event["tokens"]:
            assert len(event["text"]) == event["tokens"] and len(event["drafted_text"]) == event["drafted"]
    assert sum(len(e["drafted_text"]) for e in texts) == sum(e["drafted"] for e in texts) > 0


def test_detokenising_work_per_step_does_not_grow_with_the_answer():
    tokenizer = PieceTokenizer(_pieces(), merging)
    target = _target(tokenizer)
    engine = Engine(target, TenantStreams("ar", VOCAB))
    try:
        texts, done = _run(engine, "default", target.sample_prompt(32, seed=1), 600)
    finally:
        engine.shutdown(5)
    assert done["usage"]["completion_tokens"] == 600 and "".join(e["text"] for e in texts) == done["text"]
    # one whole decode at the end, otherwise a few windows of recent tokens per step (the old
    # whole-answer decode per step read ~180,000 tokens here)
    assert tokenizer.decoded_tokens <= 600 + 12 * 600


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2.5-vl"])
def test_a_real_tokenizer_streams_exactly_its_whole_decode(model):
    from tests.conftest import load_target

    tokenizer = load_target(model).tokenizer
    rng = np.random.default_rng(0)
    text = "Héllo wörld, naïve café: déjà vu! 日本語のテキスト、中文。 Emoji 🎉🚀👩‍👩‍👧 don't , ; ?\n\n  done"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + rng.integers(0, len(tokenizer), 200).tolist()
    for _ in range(10):  # steps of 1-5 tokens, as drafts get accepted
        detokenizer, deltas, start = IncrementalDetokenizer(tokenizer), [], 0
        while start < len(ids):
            size = int(rng.integers(1, 6))
            deltas.append(detokenizer.add(ids[start:start + size], int(rng.integers(0, size + 1)))[0])
            start += size
        rest, _, whole = detokenizer.finish()
        assert "".join(deltas) + rest == whole == tokenizer.decode(ids, skip_special_tokens=True)
        assert not any(delta.endswith("\ufffd") for delta in deltas)


def test_held_back_bytes_are_sent_once_the_character_is_complete():
    tokenizer = PieceTokenizer([b"<s>", b"a", b"\xc3", b"\xa9", b"\xf0\x9f", b"\x98", b"\x80"])
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add([1]) == ("a", "")
    assert detokenizer.add([2], drafted=1) == ("", "")        # half of 'é', drafted
    assert detokenizer.add([3, 1], drafted=1) == ("éa", "é")  # its drafted other half: 'é' was drafted
    assert detokenizer.add([2], drafted=1) == ("", "")
    assert detokenizer.add([3]) == ("é", "")                  # completed by the target's own token
    assert detokenizer.add([4, 5]) == ("", "")
    assert detokenizer.finish() == ("\ufffd", "", "aéaé\ufffd")  # cut inside an emoji: as decode() says


# ----------------------------------------------------------------------------- memory files
def _warm_proposer(target: SyntheticTarget, **options) -> RecapProposer:
    proposer = RecapProposer(**options)
    for seed in range(2):
        decode(target, proposer, target.sample_prompt(40, seed=seed), max_new_tokens=30)
    return proposer


def _bad_file(path, kind: str, proposer: RecapProposer) -> None:
    keys, ids, probs = proposer.memory.unigram_arrays()
    trials, accepts = proposer.calibrator.trials, proposer.calibrator.accepts
    if kind == "calibration cells":
        trials, accepts = trials[:-3], accepts[:-3]
    else:  # rows wider than top_k
        ids, probs = np.pad(ids, ((0, 0), (0, 4))), np.pad(probs, ((0, 0), (0, 4)))
    save_token_memory(path, keys, ids, probs, vocab_size=VOCAB, store=np.asarray(proposer.store.flat()),
                      calibration=(trials, accepts))
    read_token_memory(path)  # it loads: only installing it would fail


@pytest.mark.parametrize("kind", ["calibration cells", "wider rows"])
def test_a_memory_file_that_cannot_be_installed_is_moved_aside_once(tmp_path, caplog, kind):
    target = _target()
    path = tmp_path / "default.safetensors"
    _bad_file(path, kind, _warm_proposer(target))
    original = path.read_bytes()
    engine = Engine(target, TenantStreams("recap", VOCAB, memory_dir=tmp_path))
    try:
        with caplog.at_level(logging.WARNING, logger="recap.serve"):
            finals = [_run(engine, "default", target.sample_prompt(40, seed=seed), 20)[1] for seed in range(3)]
    finally:
        engine.shutdown(5)
    assert [f["type"] for f in finals] == ["done"] * 3  # not a 500 for every request
    asides = [p for p in tmp_path.iterdir() if p.name.startswith("default.safetensors.unreadable-")]
    assert len(asides) == 1 and asides[0].read_bytes() == original
    assert sum("moved to" in r.getMessage() for r in caplog.records) == 1
    fresh = read_token_memory(path)  # the fresh stream's own save, never the half-installed file
    assert fresh.calibration is not None and len(fresh.calibration[0]) == len(RecapProposer().calibrator.trials)
    assert fresh.ids.shape[1] <= 8


@pytest.mark.parametrize("kind", ["calibration cells", "wider rows"])
def test_a_bad_memory_file_leaves_a_warm_stream_as_it_was(tmp_path, kind):
    target = _target()
    proposer = _warm_proposer(target)
    path = tmp_path / "bad.safetensors"
    _bad_file(path, kind, _warm_proposer(target, store_tokens=64))
    before = ([a.copy() for a in proposer.memory.unigram_arrays()], proposer.calibrator.trials.copy(),
              proposer.store.flat())
    with pytest.raises(MemoryFileError):
        proposer.load_memory(path)
    keys, ids, probs = proposer.memory.unigram_arrays()
    assert np.array_equal(keys, before[0][0]) and np.array_equal(ids, before[0][1])
    assert np.array_equal(probs, before[0][2]) and np.array_equal(proposer.calibrator.trials, before[1])
    assert proposer.store.flat() == before[2]
    decode(target, proposer, target.sample_prompt(40, seed=5), max_new_tokens=10)


def test_a_file_for_another_vocabulary_fails_its_first_request_only(tmp_path):
    target = _target()
    path = tmp_path / "other.safetensors"
    save_token_memory(path, np.array([1, 2]), np.array([[1, 2], [3, 4]]), np.full((2, 2), 0.5),
                      vocab_size=VOCAB + 1)
    proposer = RecapProposer(memory_file=path)
    prompt = target.sample_prompt(20)
    with pytest.raises(MemoryFileError, match="vocabulary"):
        decode(target, proposer, prompt, max_new_tokens=4)
    assert proposer.vocab_size is None  # nothing changed before the check
    assert decode(target, proposer, prompt, max_new_tokens=4).tokens == target.greedy(prompt, 4)


# ----------------------------------------------------------------------------- concurrent saves
class _SlowSaver:
    """A stream whose save can be caught in the act."""

    def __init__(self):
        self.inside = 0
        self.most_inside = 0
        self.saves = 0
        self._lock = threading.Lock()

    def memory_snapshot(self) -> _SlowSaver:
        return self

    def write(self, path, metadata=None) -> None:
        with self._lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        threading.Event().wait(0.2)  # long enough for a second, unserialised save to come in
        with self._lock:
            self.inside -= 1
            self.saves += 1


def test_saves_of_one_tenant_never_overlap(tmp_path):
    tenants = TenantStreams("ar", VOCAB, memory_dir=tmp_path)
    saver = tenants.streams["default"] = _SlowSaver()
    threads = [threading.Thread(target=tenants.save, args=("default",)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert tenants.flush(30)
    assert saver.saves + tenants.saver.coalesced == 3 and saver.most_inside == 1


class _BlockingProposer(AutoregressiveProposer):
    """Holds its first step until released: a request in flight."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def propose(self, history, limits=None):
        self.entered.set()
        assert self.release.wait(60)
        return super().propose(history, limits)

    def memory_snapshot(self) -> _BlockingProposer:
        return self

    def write(self, path, metadata=None) -> None:
        self.saved = getattr(self, "saved", 0) + 1


def test_no_save_reads_a_stream_while_a_request_changes_it(tmp_path):
    target = _target()
    tenants = TenantStreams("ar", VOCAB, memory_dir=tmp_path)
    proposer = tenants.streams["default"] = _BlockingProposer()
    engine = Engine(target, tenants)
    finished = threading.Event()
    engine.submit(Job(tenant="default", inputs=target.sample_prompt(16), max_tokens=4,
                      emit=lambda event: event["type"] in ("done", "error") and finished.set()))
    assert proposer.entered.wait(60)
    assert tenants.save("default", timeout=0.0) is False  # the shutdown's save gives up on a busy stream
    assert getattr(proposer, "saved", 0) == 0
    proposer.release.set()
    assert finished.wait(60)
    engine.shutdown(5)
    assert proposer.saved + tenants.saver.coalesced == 2  # after the request, then at shutdown


def test_concurrent_saves_of_one_file_use_their_own_temporary_files(tmp_path, monkeypatch):
    import recap.core.persistence as persistence

    real = persistence.write_private
    both_inside = threading.Barrier(2, timeout=30)
    names: list[str] = []

    def write_private(filename, data):
        names.append(filename)
        real(filename, data)
        both_inside.wait()  # the two writers hold their temporary files at the same time

    monkeypatch.setattr(persistence, "write_private", write_private)
    path = tmp_path / "tenant.safetensors"
    errors: list[BaseException] = []

    def write(n: int) -> None:
        try:
            save_token_memory(path, np.arange(n), np.ones((n, 2), dtype=np.int64), np.full((n, 2), 0.5),
                              vocab_size=VOCAB)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=write, args=(n,)) for n in (3, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and len(set(names)) == 2
    assert len(read_token_memory(path).keys) in (3, 5)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_failed_save_leaves_no_temporary_file(tmp_path, monkeypatch):
    from recap.core import persistence

    monkeypatch.setattr(persistence.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError, match="disk gone"):
        save_token_memory(tmp_path / "m.safetensors", np.arange(2), np.ones((2, 2), dtype=np.int64),
                          np.full((2, 2), 0.5), vocab_size=VOCAB)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- the KV cache
def test_a_proposer_that_fails_to_end_its_request_still_frees_the_kv_cache():
    class Failing(AutoregressiveProposer):
        def end_request(self) -> None:
            raise RuntimeError("end_request failed")

    target = _target()
    released = []
    target.release = lambda: released.append(True)
    with pytest.raises(RuntimeError, match="end_request failed"):
        decode(target, Failing(), target.sample_prompt(12), max_new_tokens=5)
    assert released == [True]


# ----------------------------------------------------------------------------- growth over a server's life
def test_chosen_sizes_are_bounded_and_keep_their_totals():
    from recap.bench.calibration import CHOSEN_NODES, snapshot, unit_fields

    assert isinstance(RecapProposer().chosen_sizes, ChosenSizes)
    proposer = types.SimpleNamespace(chosen_sizes=ChosenSizes(window=8))
    for size in range(100):
        proposer.chosen_sizes.append(size)
    before = snapshot(proposer)
    for size in (10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120):  # more than the window holds
        proposer.chosen_sizes.append(size)
    sizes = proposer.chosen_sizes
    assert len(sizes) == 8 and list(sizes) == [50, 60, 70, 80, 90, 100, 110, 120] and sizes[-1] == 120
    assert sizes.steps == 112 and sizes.total == sum(range(100)) + 780
    assert unit_fields(proposer, before)[CHOSEN_NODES] == 65.0


def test_a_long_stream_chooses_sizes_without_keeping_each_one():
    target = _target()
    proposer = RecapProposer()
    proposer.chosen_sizes = ChosenSizes(window=16)
    for seed in range(3):
        decode(target, proposer, target.sample_prompt(40, seed=seed), max_new_tokens=40)
    assert len(proposer.chosen_sizes) == 16 < proposer.chosen_sizes.steps


def test_the_memory_pool_gives_back_rows_after_an_eviction():
    memory = FastMemory(VOCAB, 4)
    keys = np.arange(VOCAB)
    memory.load_unigram(keys, np.ones((VOCAB, 4), dtype=np.int64), np.full((VOCAB, 4), 0.25))
    assert memory.pool_rows[1] >= VOCAB
    memory.drop_unigram(keys[8:])
    memory.reset_request()
    used, capacity = memory.pool_rows
    assert used == 8 and capacity == 256  # back to the minimum, not the peak
    memory.load_unigram(keys[8:20], np.ones((12, 4), dtype=np.int64), np.full((12, 4), 0.25))
    assert memory.counts()[0] == 20 and memory.table("unigram")[(3,)][0] == (1, 1, 1, 1)


def test_the_eviction_order_survives_a_restart(tmp_path):
    """A bound that keeps more than one request's tokens but not two: which older rows go
    depends on recency (without it, a restarted stream dropped the lowest token ids)."""
    target = _target()
    prompts = [target.sample_prompt(20, seed=seed) for seed in range(4)]
    continuous = make_proposer("recap-paper", max_memory_rows=60)
    for prompt in prompts[:2]:
        decode(target, continuous, prompt, max_new_tokens=10)
    continuous.save_memory(tmp_path / "m.safetensors")
    restarted = make_proposer("recap-paper", max_memory_rows=60, memory_file=tmp_path / "m.safetensors")
    for prompt in prompts[2:]:
        for proposer in (continuous, restarted):
            decode(target, proposer, prompt, max_new_tokens=10)
        assert np.array_equal(continuous.memory.unigram_arrays()[0], restarted.memory.unigram_arrays()[0])


def test_version_2_memory_files_still_load(tmp_path):
    from safetensors.numpy import save_file

    from recap.core import persistence

    keys, ids, probs = np.array([3, 5]), np.array([[1, 2], [3, 4]]), np.full((2, 2), 0.5, dtype=np.float32)
    tensors = {"keys": keys, "ids": ids, "probs": probs, "store": np.array([7, 8, -1]),
               "calibration_trials": np.zeros(0), "calibration_accepts": np.zeros(0)}
    order = ("keys", "ids", "probs", *persistence.EXTRA_TENSORS)
    save_file(tensors, str(tmp_path / "v2.safetensors"),
              metadata={"format": persistence.FORMAT, "version": "2", "vocab_size": str(VOCAB), "top_k": "2",
                        "sha256": persistence._checksum(*(tensors[name] for name in order))})
    saved = read_token_memory(tmp_path / "v2.safetensors")
    assert saved.last_seen is None and saved.store.tolist() == [7, 8, -1]
    proposer = make_proposer("recap", max_memory_rows=4, memory_file=tmp_path / "v2.safetensors")
    decode(_target(), proposer, [3, 5, 9], max_new_tokens=3)
    assert proposer.store.flat()[:3] == [7, 8, -1]


def test_custom_generate_lets_a_dropped_model_go():
    from recap.hf import custom_generate

    loaded = recap.load("tiny-llama")
    model, inputs = loaded.model, loaded.prepare("Hello there.")
    del loaded
    generate = custom_generate("ar")
    model.generate(input_ids=inputs.input_ids, max_new_tokens=3, do_sample=False, custom_generate=generate)
    assert len(generate._targets) == 1
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None and len(generate._targets) == 0


# ----------------------------------------------------------------------------- custom_generate
def test_max_time_stops_custom_generate_after_the_step_that_ran_past_it(monkeypatch):
    from transformers.generation import stopping_criteria

    from recap.hf import custom_generate
    from tests.conftest import load_target

    target = load_target("tiny-llama")
    ids = target.prepare("Tell me about the sea.").input_ids
    reference = target.model.generate(input_ids=ids, max_new_tokens=12, do_sample=False)
    ticks = iter(range(1000))  # a clock that advances one second each time it is read
    monkeypatch.setattr(stopping_criteria, "time", types.SimpleNamespace(time=lambda: float(next(ticks))))
    out = target.model.generate(input_ids=ids, max_new_tokens=12, do_sample=False, max_time=2.5,
                                custom_generate=custom_generate("ar"))
    # started at 0; read at 1, 2, then 3 > 2.5 after the third token: generate's own rule
    assert out.shape[1] == ids.shape[1] + 3 and out.tolist()[0] == reference.tolist()[0][: ids.shape[1] + 3]


@pytest.mark.measured_cost_profile
def test_the_first_cost_aware_call_says_what_it_measures_and_where(tmp_path, monkeypatch):
    from recap.core import CostProfile
    from recap.hf import custom_generate
    from recap.verifier import profile
    from tests.conftest import load_target

    monkeypatch.setenv("RECAP_CACHE", str(tmp_path))
    monkeypatch.setattr(profile, "measure_profile", lambda target, **_: CostProfile.linear(0.06))
    target = load_target("tiny-llama")
    ids = target.prepare("Tell me about the sea.").input_ids
    generate = custom_generate("recap")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            target.model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, custom_generate=generate)
        target.model.generate(input_ids=ids, max_new_tokens=4, do_sample=False,
                              custom_generate=custom_generate("recap", cost_profile="flat"))
    said = [str(w.message) for w in caught if "verify cost" in str(w.message)]
    assert len(said) == 1 and str(tmp_path / "profiles") in said[0] and "RECAP_CACHE" in said[0]
    assert "cost_profile=" in said[0] and len(list((tmp_path / "profiles").iterdir())) == 1


def test_a_memory_files_metadata_is_read_from_its_header_alone(tmp_path):
    """`persistence.file_metadata` (what a server reads a tenant file's version with): the
    saved fields back; a truncated or garbled header is a ValueError (damage), a missing file
    FileNotFoundError."""
    from recap.core.persistence import file_metadata, save_token_memory

    path = tmp_path / "m.safetensors"
    save_token_memory(path, np.array([3], np.int64), np.array([[4, 5]], np.int64), np.array([[0.6, 0.4]]),
                      vocab_size=10, metadata={"recap_revision": "7"})
    fields = file_metadata(path)
    assert fields["recap_revision"] == "7" and fields["vocab_size"] == "10"
    data = path.read_bytes()
    for damaged in (data[:5], data[:8] + b"{not json", (2**40).to_bytes(8, "little") + data[8:]):
        path.write_bytes(damaged)
        with pytest.raises(ValueError):
            file_metadata(path)
    with pytest.raises(FileNotFoundError):
        file_metadata(tmp_path / "absent.safetensors")
