"""The RECAP proposer end to end: streams, memory files, ablations, losslessness."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import recap
import recap.check as check_module
from recap.check import run_check
from recap.cli import main
from recap.core import CostProfile
from recap.core.persistence import MemoryFileError
from recap.decoding import reference_generate
from recap.prompts import check_prompts
from recap.proposers import ABLATIONS, RecapProposer

from .conftest import load_target
from .helpers import assert_drafted
from .reference_recap import make_row, plant_unigram


def _assert_all_passed(report):
    failures = [(case.index, case.first_difference) for case in report.cases if not case.passed]
    assert not failures, f"{len(failures)} mismatches (case, first differing token): {failures}"


CPU_LIKE = CostProfile.linear(0.05)
"""t(N) = 1 + 0.05 (N - 1): a verify-cost curve like a small CPU's."""


def _check(monkeypatch, target, method, cost=CPU_LIKE, **options):
    """`run_check` with every decode given ``cost`` (cost-aware RECAP would otherwise measure
    this machine's profile, making the trees depend on the load at that moment)."""

    def decode_with_cost(*args, **kwargs):
        if kwargs.get("cost") is None:
            kwargs["cost"] = cost
        return recap.decode(*args, **kwargs)

    monkeypatch.setattr(check_module, "decode", decode_with_cost)
    return run_check(target, method, **options)


def _repeated(target, count):
    """``count`` built-in (prompt, image) pairs, each asked twice in a row: random-weight models
    only give RECAP something to recycle when a request repeats."""
    return [item for item in check_prompts(count, images=target.accepts_images) for _ in range(2)]


# ----------------------------------------------------------------------------- losslessness
def test_recap_is_lossless_on_tiny_architectures(tiny_target, monkeypatch):
    """(``recap-paper`` on every architecture: tests/test_recap_cost_aware.py.)"""
    report = _check(monkeypatch, tiny_target, "recap", items=_repeated(tiny_target, 15), max_new_tokens=40, vary=True,
                    seed=11)
    _assert_all_passed(report)
    assert_drafted(report, min_accepted=50)


@pytest.mark.parametrize("ablation", list(ABLATIONS))
def test_every_ablation_is_lossless(ablation, monkeypatch):
    target = load_target("tiny-qwen2.5-vl")
    report = _check(monkeypatch, target, RecapProposer(ablation=ablation), items=_repeated(target, 3),
                    max_new_tokens=24, seed=12)
    _assert_all_passed(report)
    assert_drafted(report)


@pytest.mark.slow
def test_recap_is_lossless_and_recycles_on_smollm2(smollm2, monkeypatch):
    paper = run_check(smollm2, "recap-paper", prompts=5, max_new_tokens=32, seed=13)
    _assert_all_passed(paper)
    assert_drafted(paper, min_accepted=20)
    assert paper.tau > 1.5  # a real model's own predictions are worth recycling
    # Cost-aware, under a CPU-like curve (t(64) ~ 4.8 t(1)): smaller trees, still accepted.
    report = _check(monkeypatch, smollm2, "recap", CostProfile.linear(0.06), prompts=5, max_new_tokens=32, seed=13)
    _assert_all_passed(report)
    assert_drafted(report, min_accepted=10)


def _random_rows(draw, vocab, count):
    rows = {}
    for _ in range(count):
        key = draw(st.integers(0, vocab - 1))
        ids = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8, unique=True))
        weights = draw(st.lists(st.floats(0.01, 1.0), min_size=len(ids), max_size=len(ids)))
        total = sum(weights)
        probs = tuple(w / total for w in weights)
        rows[key] = make_row(tuple(ids), probs, float(np.exp(sum(p * np.log(p) for p in probs))))
    return rows


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_whatever_the_memory_holds_the_output_is_greedy(tiny_llama, data):
    """Random rows, rows mostly pointing at the history's own tokens, or garbage: same output.
    (That planted true rows do get drafted and accepted: tests/test_recap_cost_aware.py,
    test_true_rows_or_a_stored_answer_are_drafted_and_accepted.)"""
    inputs = tiny_llama.prepare("Memory property test.")
    reference = reference_generate(tiny_llama, inputs, 20)
    proposer = RecapProposer()
    vocab = tiny_llama.vocab_size
    rows = _random_rows(data.draw, vocab, data.draw(st.integers(0, 30)))
    # Plant rows keyed by the actual history so drafts are proposed and partly accepted.
    history = inputs.prompt_ids + reference
    for position in data.draw(st.lists(st.integers(0, len(history) - 2), max_size=20)):
        decoy = data.draw(st.integers(0, vocab - 1))
        rows[history[position]] = make_row((history[position + 1], decoy), (0.6, 0.4), 0.5)
    result = _decode_with_preloaded(tiny_llama, proposer, inputs, rows)
    assert result.tokens == reference


def _decode_with_preloaded(target, proposer, inputs, rows):
    """decode() seeds U from the prompt at begin_request; plant our rows right after."""
    original = proposer.begin_request

    def begin(prompt):
        original(prompt)
        plant_unigram(proposer.memory, rows)

    proposer.begin_request = begin
    return recap.decode(target, proposer, inputs, max_new_tokens=20)


def _recording(proposer: RecapProposer) -> list[tuple]:
    """Every tree ``proposer`` drafts, as (tokens, parents), in order."""
    trees: list[tuple] = []
    propose = proposer.propose

    def recorded(history, limits=None):
        tree = propose(history, limits)
        trees.append((tree.tokens.tolist(), tree.parents.tolist()))
        return tree

    proposer.propose = recorded
    return trees


@pytest.mark.lossless
def test_rows_from_another_model_do_not_change_outputs(tiny_llama):
    # The donor reads tiny-llama's answers, so its rows are keyed by tokens tiny-llama will
    # generate (the receiver's own prefill reseeds the prompt tokens' rows).
    answers = [tiny_llama.tokenizer.decode(reference_generate(tiny_llama, tiny_llama.prepare(prompt), 16))
               for prompt, _ in check_prompts(4, images=False)]
    donor = RecapProposer(seed_prompt="all")  # its U: rows seeded from those answers as prompts
    run_check(load_target("tiny-llava-next"), donor, items=[(answer, None) for answer in answers], max_new_tokens=8)
    keys, ids, probs = donor.memory.unigram_arrays()
    fits = (keys < tiny_llama.vocab_size) & (ids < tiny_llama.vocab_size).all(axis=1)
    keys, ids, probs = keys[fits], ids[fits], probs[fits]
    assert len(keys) > 20

    def second_stream(foreign: bool) -> list[tuple]:
        """A stream's second pass over the same prompts, after its U is replaced by the
        donor's rows (or emptied): the outputs must be greedy; returns the trees drafted."""
        receiver = RecapProposer()
        # answers half as long as the second pass's: past them its trees come from U
        _assert_all_passed(run_check(tiny_llama, receiver, prompts=4, max_new_tokens=8))
        receiver.memory.reset_stream()
        if foreign:
            receiver.memory.load_unigram(keys, ids, probs)
            held_keys, held_ids, held_probs = receiver.memory.unigram_arrays()
            order = np.argsort(held_keys)
            assert held_keys[order].tolist() == sorted(keys.tolist())  # U is exactly the donor's rows
            np.testing.assert_array_equal(held_ids[order], ids[np.argsort(keys)])
            np.testing.assert_allclose(held_probs[order], probs[np.argsort(keys)], rtol=1e-5)
        trees = _recording(receiver)
        report = run_check(tiny_llama, receiver, prompts=4, max_new_tokens=16)
        _assert_all_passed(report)
        assert_drafted(report, min_accepted=20)  # the repeated prompts draft from the store
        return trees

    with_foreign, without = second_stream(True), second_stream(False)
    assert len(with_foreign) == len(without) > 0
    # The donor's rows were drafted from (the same stream without them drafts other trees).
    assert with_foreign != without


# ----------------------------------------------------------------------------- streams
def _unigram_keys(proposer: RecapProposer) -> set[int]:
    return set(proposer.memory.unigram_arrays()[0].tolist()) if proposer.memory is not None else set()


def test_streams_carry_unigram_across_requests_and_stay_isolated(tiny_llama):
    first, second = RecapProposer(), RecapProposer()
    recap.generate(tiny_llama, "Stream one, request one.", method=first, max_new_tokens=8)
    after_one = _unigram_keys(first)
    u_rows, c_rows, g_rows = first.memory_counts()
    assert after_one and u_rows == len(after_one) and c_rows == g_rows == 0  # C/G are request-local
    assert not _unigram_keys(second)  # nothing leaked into the other stream
    recap.generate(tiny_llama, "Stream one, request two.", method=first, max_new_tokens=8)
    assert after_one <= _unigram_keys(first)  # U kept (and grown)
    first.reset_stream()
    assert not _unigram_keys(first)

    reset_u = RecapProposer(ablation="reset-U")
    recap.generate(tiny_llama, "Request one.", method=reset_u, max_new_tokens=8)
    before = _unigram_keys(reset_u)
    inputs = tiny_llama.prepare("A different second prompt entirely")
    reset_u.begin_request(tiny_llama.prefill(inputs)[0])
    tiny_llama.release()
    assert _unigram_keys(reset_u) <= set(inputs.prompt_ids) and before - set(inputs.prompt_ids)


def test_persistent_context_ablation_keeps_c_and_g_across_requests(tiny_llama):
    kept, local = RecapProposer(ablation="persistent-CG"), RecapProposer()
    for proposer in (kept, local):
        recap.generate(tiny_llama, "Stream one, request one.", method=proposer, max_new_tokens=8)
    _, c_rows, g_rows = kept.memory_counts()
    assert c_rows > 0 and g_rows > 0 and local.memory_counts()[1:] == (0, 0)
    recap.generate(tiny_llama, "Another request.", method=kept, max_new_tokens=8)
    assert kept.memory_counts()[1] >= c_rows and kept.memory_counts()[2] >= g_rows
    kept.reset_stream()
    assert kept.memory_counts() == (0, 0, 0)


# ----------------------------------------------------------------------------- memory files
@pytest.fixture
def memory_file(tiny_llama, tmp_path):
    proposer = RecapProposer()
    recap.generate(tiny_llama, "Fill the memory please.", method=proposer, max_new_tokens=12)
    path = tmp_path / "u.safetensors"
    proposer.save_memory(path)
    return proposer, path


def test_memory_round_trip(tiny_llama, memory_file):
    saved, path = memory_file
    loaded = RecapProposer(memory_file=path)
    inputs = tiny_llama.prepare("x")
    loaded.begin_request(tiny_llama.prefill(inputs)[0])
    tiny_llama.release()
    saved_keys, saved_ids, saved_probs = saved.memory.unigram_arrays()
    keys, ids, probs = loaded.memory.unigram_arrays()
    position = {key: i for i, key in enumerate(keys.tolist())}
    checked = 0
    for i, key in enumerate(saved_keys.tolist()):
        if key in inputs.prompt_ids:
            continue  # reseeded by this prompt's prefill
        assert key in position
        assert ids[position[key]].tolist() == saved_ids[i].tolist()
        assert probs[position[key]] == pytest.approx(saved_probs[i], rel=1e-5)
        checked += 1
    assert checked > 10


def test_memory_file_carries_the_output_store_and_the_calibration(tiny_llama, memory_file, tmp_path):
    from recap.core.cost import CostProfile
    from recap.decoding import decode

    saved, path = memory_file
    for _ in range(2):  # the same request twice: the second drafts from the store and labels nodes
        decode(tiny_llama, saved, tiny_llama.prepare("A second request for the store."), max_new_tokens=10,
               cost=CostProfile.flat())
    saved.save_memory(path)
    assert saved.store.flat().count(-1) == 3 and saved.calibrator.trials.sum() > 0
    loaded = RecapProposer(memory_file=path)
    loaded.begin_request(tiny_llama.prefill(tiny_llama.prepare("x"))[0])
    tiny_llama.release()
    assert loaded.store.flat() == saved.store.flat()
    assert loaded.calibrator.trials.tolist() == saved.calibrator.trials.tolist()
    assert loaded.calibrator.accepts.tolist() == saved.calibrator.accepts.tolist()
    assert loaded.calibrator.expected.tolist() == saved.calibrator.expected.tolist()
    touched = saved.calibrator.trials > 0
    assert np.allclose(loaded.calibrator.estimate(np.flatnonzero(touched)),
                       saved.calibrator.estimate(np.flatnonzero(touched)))
    # an ablation without a store or calibration ignores those parts of the file
    bare = RecapProposer(ablation="no-store", memory_file=path)
    bare.begin_request(tiny_llama.prefill(tiny_llama.prepare("x"))[0])
    tiny_llama.release()
    assert bare.store.flat() == []


def test_a_memory_file_saved_without_expected_acceptances_counts_trials_at_the_cell_prior(tiny_llama, tmp_path):
    """Version 3 files kept (trials, accepts) only: they load as if every labelled node had sat
    at its cell's prior, the estimate calibrations made before the expected counts."""
    from recap.core import persistence

    proposer = RecapProposer()
    recap.generate(tiny_llama, "Counting for the calibration.", method=proposer, max_new_tokens=10)
    calibrator = proposer.calibrator
    keys, ids, probs = proposer.memory.unigram_arrays()
    path = tmp_path / "no-expected.safetensors"
    persistence.save_token_memory(path, keys, ids, probs, vocab_size=proposer.vocab_size,
                                  calibration=(calibrator.trials, calibrator.accepts))
    assert persistence.read_token_memory(path).calibration[2] is None
    loaded = RecapProposer(memory_file=path)
    loaded.begin_request(tiny_llama.prefill(tiny_llama.prepare("x"))[0])
    tiny_llama.release()
    assert np.allclose(loaded.calibrator.expected, calibrator.trials * calibrator.prior)


def test_a_memory_bound_evicts_the_rows_of_tokens_not_seen_lately(tiny_llama):
    bounded = RecapProposer(max_memory_rows=20)
    free = RecapProposer()
    for prompt in ("First request about apples and pears.", "Second one on boats, trains and planes."):
        for proposer in (bounded, free):
            result = recap.generate(tiny_llama, prompt, method=proposer, max_new_tokens=12)
    assert free.memory_counts()[0] > 20 == bounded.memory_counts()[0]
    kept = set(bounded.memory.unigram_arrays()[0].tolist())
    latest = set(tiny_llama.prepare("Second one on boats, trains and planes.").input_ids[0].tolist()) \
        | set(result.tokens)
    # the latest request's tokens go last: either only they are left, or all of theirs are
    assert kept <= latest or (latest & set(free.memory.unigram_arrays()[0].tolist())) <= kept
    with pytest.raises(recap.InputError):
        RecapProposer(max_memory_rows=0)


def test_version_1_memory_files_still_load(tiny_llama, memory_file, tmp_path):
    from safetensors.numpy import save_file

    from recap.core import persistence

    saved, _ = memory_file
    keys, ids, probs = saved.memory.unigram_arrays()
    keys, ids, probs = keys.astype(np.int64), ids.astype(np.int64), probs.astype(np.float32)
    old = tmp_path / "v1.safetensors"
    save_file({"keys": keys, "ids": ids, "probs": probs}, str(old),
              metadata={"format": persistence.FORMAT, "version": "1", "vocab_size": str(saved.vocab_size),
                        "top_k": str(ids.shape[1]), "sha256": persistence._checksum(keys, ids, probs)})
    read = persistence.read_token_memory(old)
    assert read.calibration is None and read.store.size == 0 and len(read.keys) == len(keys)
    loaded = RecapProposer(memory_file=old)
    loaded.begin_request(tiny_llama.prefill(tiny_llama.prepare("x"))[0])
    tiny_llama.release()
    assert loaded.memory_counts()[0] >= len(keys) - 5 and loaded.store.flat() == []


def test_a_save_never_leaves_a_temporary_file_or_a_partial_memory(tiny_llama, memory_file, monkeypatch):
    from recap.core import persistence

    saved, path = memory_file
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(persistence.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        saved.save_memory(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_corrupted_truncated_and_foreign_files_are_refused(tiny_llama, memory_file, tmp_path):
    _, path = memory_file
    data = bytearray(path.read_bytes())
    corrupted = tmp_path / "corrupted.safetensors"
    data[-5] ^= 0xFF
    corrupted.write_bytes(bytes(data))
    with pytest.raises(MemoryFileError, match="checksum"):
        RecapProposer(memory_file=corrupted)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(MemoryFileError, match="truncated"):
        RecapProposer(memory_file=truncated)
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x00" * 64)
    with pytest.raises(MemoryFileError):
        RecapProposer(memory_file=garbage)
    with pytest.raises(MemoryFileError, match="not found"):
        RecapProposer(memory_file=tmp_path / "missing")
    other_vocab = RecapProposer(memory_file=path)
    qwen = load_target("tiny-qwen2.5-vl")  # 49156 tokens, the file says 49152
    with pytest.raises(MemoryFileError, match="vocabulary"):
        recap.generate(qwen, "hi", method=other_vocab, max_new_tokens=2)


def test_cli_memory_file_round_trip_and_bad_file(capsys, tmp_path):
    path = tmp_path / "stream.safetensors"
    args = ["generate", "--model", "tiny-llama", "--prompt", "hello", "--method", "recap", "--memory", str(path),
            "--max-new-tokens", "6"]
    assert main(args) == 0 and path.exists()
    assert main(args) == 0  # loads it, then saves again
    path.write_bytes(b"broken")
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "memory file" in err[0]


def test_recap_options_are_refused_for_other_methods(capsys):
    # (generate's default method is recap: name another one)
    assert main(["generate", "--model", "tiny-llama", "--prompt", "hi", "--method", "pld", "--ablation", "gate"]) == 2
    assert "apply to --method recap" in capsys.readouterr().err


def test_unknown_ablation_via_api():
    with pytest.raises(recap.InputError, match="unknown ablation"):
        RecapProposer(ablation="everything")
