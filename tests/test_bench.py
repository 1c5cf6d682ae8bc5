"""`recap bench`: metric definitions, data validation, pairing, resume, reports, CLI errors.

End-to-end runs use the tiny random models and a tiny MMSpec-format data set written to
tmp_path (two single-turn items and one two-turn item), with a few new tokens per unit.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from PIL import Image

import recap
from recap.bench import BenchConfig, metrics, run_bench
from recap.bench import data as bench_data
from recap.bench import runner as bench_runner
from recap.bench.results import ResultsFile
from recap.bench.streams import StreamCheckpoints, parse_methods
from recap.cli import main
from recap.core import DraftTree
from recap.errors import InputError
from recap.proposers import PROPOSERS, BaseProposer, RecapProposer
from recap.verifier import acceptance
from tests.broken_verifiers import first_child_walk
from tests.conftest import load_target

TOKENS = 6


def _row(unit, method, n, t, topic="t", accepted=0, iterations=1, identical=True):
    return {"unit": unit, "method": method, "n_tokens": n, "time_s": t, "topic": topic, "accepted": accepted,
            "iterations": iterations, "identical": identical, "first_difference": None if identical else 0,
            "prefill_s": 0.1, "propose_s": 0.0, "verify_s": 0.0, "observe_s": 0.0, "draft_nodes": 0}


# --------------------------------------------------------------------------------------------- metrics
def test_speedup_is_the_mean_of_paired_ratios_not_the_ratio_of_means():
    rows = [_row("a", "ar", 10, 1.0), _row("a", "m", 10, 0.25),      # 10 tok/s vs 40 tok/s: ratio 4
            _row("b", "ar", 100, 1.0), _row("b", "m", 100, 2.0)]     # 100 tok/s vs 50 tok/s: ratio 0.5
    ratios = [r for _, r in metrics.paired_ratios(rows, "m")]
    assert ratios == [4.0, 0.5]
    summary = metrics.summarise_method(rows, "m", ["t"])
    assert summary["S"] == pytest.approx(2.25)
    ratio_of_means = (40 + 50) / 2 / ((10 + 100) / 2)
    assert summary["S"] != pytest.approx(ratio_of_means)
    assert summary["ratio"]["faster_share"] == 0.5


def test_tau_counts_the_bonus_token_and_skips_units_without_iterations():
    assert metrics.unit_tau(6, 3) == 3.0          # 2 accepted drafts per step + the target's own token
    assert metrics.unit_tau(0, 4) == 1.0          # nothing accepted: AR's tau
    assert metrics.unit_tau(0, 0) is None         # EOS right after prefill: no verification at all
    rows = [_row("a", "m", 7, 1, accepted=6, iterations=3), _row("b", "m", 4, 1, accepted=2, iterations=4),
            _row("c", "m", 1, 1, accepted=0, iterations=0)]
    assert metrics.method_tau(rows) == pytest.approx((3.0 + 1.5) / 2)


def test_overall_values_weight_every_turn():
    rows = [_row("s#0", "ar", 10, 1.0, "single"), _row("s#0", "m", 10, 0.5, "single", accepted=3, iterations=1)]
    for turn in range(3):
        rows += [_row(f"mt#{turn}", "ar", 10, 1.0, "multi"), _row(f"mt#{turn}", "m", 10, 1.0, "multi")]
    summary = metrics.summarise_method(rows, "m", ["single", "multi"])
    assert summary["topics"]["single"]["S"] == 2.0 and summary["topics"]["multi"]["S"] == 1.0
    assert summary["S"] == pytest.approx((2 + 1 + 1 + 1) / 4)     # not the mean of topic means (1.5)
    assert summary["tau"] == pytest.approx((4 + 1 + 1 + 1) / 4)
    assert summary["units"] == 4 and summary["topics"]["multi"]["units"] == 3


def test_percentiles_interpolate_like_numpy():
    assert metrics.percentile([4, 1, 3, 2], 50) == 2.5
    assert metrics.percentile([1, 2, 3, 4], 10) == pytest.approx(1.3)
    assert metrics.percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert metrics.percentile([5.0], 99) == 5.0
    assert math.isnan(metrics.percentile([], 50))
    rng = np.random.default_rng(0)
    for size in (2, 7, 31):
        values = rng.exponential(size=size).tolist()
        for q in (10, 50, 90, 95, 99):
            assert metrics.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    with pytest.raises(ValueError):
        metrics.percentile([1.0], 101)


def test_latency_and_first_difference():
    rows = [_row(str(i), "ar", 1, float(i)) for i in range(1, 101)]
    latency = metrics.latency(rows)
    assert latency["p50"] == pytest.approx(50.5) and latency["p99"] == pytest.approx(99.01)
    assert metrics.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert metrics.first_difference([1, 2], [1, 2, 3]) == 2


# --------------------------------------------------------------------------------------------- data
def write_dataset(folder, rows=None, *, image_size=(40, 30)):
    """A tiny MMSpec-format data set: two single-turn items and one two-turn item."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "images").mkdir(exist_ok=True)
    rows = rows or [
        {"id": "a1", "image": "a1.png", "turns": ["What colour is the square?"], "category": "x", "topic": "alpha"},
        {"id": "a2", "image": "a2.png", "turns": ["Count the shapes."], "category": "x", "topic": "alpha"},
        {"id": "m1", "image": "m1.png", "turns": ["Describe the picture.", "Now say it shorter."],
         "category": "y", "topic": "multi turn"},
    ]
    for index, row in enumerate(rows):
        if isinstance(row, dict) and row.get("image"):
            Image.new("RGB", image_size, (40 * index, 100, 200)).save(folder / "images" / row["image"])
    (folder / "mmspec.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return folder


def test_data_loads_validates_and_selects(tmp_path):
    folder = write_dataset(tmp_path / "mm")
    path = bench_data.mmspec_path(f"mmspec={folder}")
    assert path == (folder / "mmspec.jsonl").resolve() and bench_data.mmspec_path(str(path)) == path
    items = bench_data.load_items(path)
    assert [i.id for i in items] == ["a1", "a2", "m1"] and items[2].turns[1] == "Now say it shorter."
    assert items[0].image == folder / "images" / "a1.png"
    assert [i.id for i in bench_data.select(items, ["Multi-Turn"], None)] == ["m1"]
    assert [i.id for i in bench_data.select(items, None, 1)] == ["a1", "m1"]
    assert [u.key for u in bench_data.units_of(items)] == ["a1#0", "a2#0", "m1#0", "m1#1"]
    with pytest.raises(InputError, match="unknown topic 'gamma'"):
        bench_data.select(items, ["gamma"], None)
    with pytest.raises(InputError, match="data not found"):
        bench_data.mmspec_path(str(tmp_path / "nowhere"))


def test_the_default_data_path_is_explained_when_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_data, "default_data_dir", lambda: tmp_path / "shared" / "data" / "mmspec")
    with pytest.raises(InputError, match="MMSpec data not found at .*; pass --data mmspec=PATH"):
        bench_data.mmspec_path("mmspec")
    write_dataset(tmp_path / "shared" / "data" / "mmspec")
    assert bench_data.mmspec_path(None) == tmp_path / "shared" / "data" / "mmspec" / "mmspec.jsonl"


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "mmspec.jsonl:2: not valid JSON"),
    (json.dumps({"id": "b", "topic": "alpha", "turns": []}), "mmspec.jsonl:2: field 'turns'"),
    (json.dumps({"id": "b", "topic": "alpha", "turns": ["q", 3]}), "field 'turns'"),
    (json.dumps({"id": "a1", "topic": "alpha", "turns": ["q"]}), "duplicate id 'a1'"),
    (json.dumps({"topic": "alpha", "turns": ["q"]}), "field 'id'"),
    ("[1, 2]", "expected a JSON object"),
])
def test_bad_rows_name_file_and_line(tmp_path, line, message):
    good = {"id": "a1", "image": "a1.png", "turns": ["q"], "category": "x", "topic": "alpha"}
    folder = write_dataset(tmp_path / "mm", [good, line])
    with pytest.raises(InputError, match=message.replace("(", r"\(")):
        bench_data.load_items(folder / "mmspec.jsonl")


def test_missing_image_is_named(tmp_path):
    folder = write_dataset(tmp_path / "mm")
    (folder / "images" / "a2.png").unlink()
    items = bench_data.load_items(folder / "mmspec.jsonl")
    with pytest.raises(InputError, match="image of item a2 not found"):
        bench_data.check_images(items)


def test_messages_carry_the_earlier_turns_and_answers(tmp_path):
    item = bench_data.load_items(write_dataset(tmp_path / "mm") / "mmspec.jsonl")[2]
    messages = bench_data.messages_for(bench_data.Unit(item, 1), ["A blue picture."])
    assert messages == [{"role": "system", "content": bench_data.MMSPEC_SYSTEM_PROMPT},
                        {"role": "user", "content": "Describe the picture."},
                        {"role": "assistant", "content": "A blue picture."},
                        {"role": "user", "content": "Now say it shorter."}]
    with pytest.raises(ValueError):
        bench_data.messages_for(bench_data.Unit(item, 1), [])


# --------------------------------------------------------------------------------------------- pairing
def test_rotation_is_seeded_cyclic_and_varies_by_input():
    labels = ["ar", "recap", "pld"]
    keys = [f"item{i}#0" for i in range(30)]
    orders = [bench_runner.rotation(labels, 0, key) for key in keys]
    assert orders == [bench_runner.rotation(labels, 0, key) for key in keys]        # reproducible
    assert len({tuple(o) for o in orders}) == 3                                      # every start occurs
    assert all(o[o.index("ar"):] + o[:o.index("ar")] == labels for o in orders)      # cyclic shifts only
    assert orders != [bench_runner.rotation(labels, 1, key) for key in keys]         # the seed matters


def test_methods_are_validated_against_the_registry():
    specs = parse_methods("pld,recap:budget=8", ())
    assert [s.label for s in specs] == ["ar", "pld", "recap:budget=8"] and specs[2].options == {"budget": 8}
    assert specs[2].make().config.budget == 8
    for bad, message in [("decoy", "unknown method 'decoy'"), ("nope", "unknown method 'nope'"),
                         ("ar", "no method"), ("pld,pld", "twice"), ("recap:budget", "key=value"),
                         ("pld:colour=3", "bad option")]:
        with pytest.raises(InputError, match=message):
            parse_methods(bad, ())


# --------------------------------------------------------------------------------------------- end to end
def _config(tmp_path, **overrides) -> BenchConfig:
    folder = tmp_path / "mm"
    if not folder.exists():
        write_dataset(folder)
    options = {"model": "tiny-llama", "methods": "pld", "data": str(folder), "max_new_tokens": TOKENS,
               "out": tmp_path / "out", "warmup": False}
    return BenchConfig(**{**options, **overrides})


def _bench(config, model="tiny-llama"):
    return run_bench(config, target=load_target(model), progress=False)


def test_end_to_end_writes_every_output(tmp_path):
    run = _bench(_config(tmp_path, methods="pld,recap", warmup=True))
    out = tmp_path / "out"
    for name in ("results.jsonl", "run.json", "summary.json", "report.md", "speedup_by_topic.png",
                 "speedup_distribution.png", "latency_cdf.png"):
        assert (out / name).is_file(), name
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    rows = ResultsFile(out).load()
    assert len(rows) == 4 * 3 and {r["method"] for r in rows} == {"ar", "pld", "recap"}
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["methods"]) == {"ar", "pld", "recap"} and summary["mismatches"] == 0
    for name, method in summary["methods"].items():
        assert isinstance(method["S"], float) and isinstance(method["tau"], float) and method["mismatches"] == 0
        assert set(method["topics"]) == {"alpha", "multi turn"}
        for topic in method["topics"].values():
            assert isinstance(topic["S"], float) and isinstance(topic["tau"], float)
        assert {"p10", "p50", "p90", "faster_share"} <= set(method["ratio"])
        assert set(method["latency_s"]) == {"p50", "p90", "p95", "p99"}
        assert name != "ar" or method["S"] == 1.0
    block = summary["run"]
    assert block["threads_pinned"] == 1 and block["dtype"] == "float32" and block["max_new_tokens"] == TOKENS
    assert block["threads_ran"] == {"torch": 1, "kernels": 1}  # read back after the run, not the request
    assert block["machine"]["cpu"] and block["versions"]["torch"] and block["versions"]["transformers"]
    assert block["images_used"] is False and block["turn_is_request"] is True and block["seed"] == 0
    assert "decodes the first unit once" in block["warmup"] and block["rotation"].startswith("cyclic")
    assert summary["topics"] == {"alpha": 2, "multi turn": 2} and summary["complete"] is True
    report = (out / "report.md").read_text()
    assert "text-only model: every question is asked without its image" in report
    assert "1 thread(s) (read back after the run: torch 1, kernels 1)" in report
    assert "| method | alpha | multi turn | overall |" in report and "![latency_cdf](latency_cdf.png)" in report
    assert "one generation unit and one request" in report and bench_data.MMSPEC_SYSTEM_PROMPT in report
    assert not any(r["has_image"] for r in rows)
    assert run.summary["methods"]["recap"]["units"] == 4


def test_a_run_on_other_threads_than_asked_writes_no_row(tmp_path, monkeypatch):
    """The kernels' thread count is read back before the first row: a run whose kernels
    would run on 2 threads under ``--threads 1`` is refused, and the read-back recorded."""
    from recap.bench import runner
    from recap.errors import RecapError

    monkeypatch.setattr(runner, "read_back", lambda kernels: {"torch": 1, "kernels": 2})
    with pytest.raises(RecapError, match="asked for 1 thread.*kernels 2"):
        _bench(_config(tmp_path))
    assert not ResultsFile(tmp_path / "out").load()
    record = json.loads((tmp_path / "out" / "run.json").read_text())
    assert record["sessions"][-1]["threads_ran"] == {"torch": 1, "kernels": 2}


def test_multi_turn_units_see_the_earlier_answer(tmp_path, monkeypatch):
    target = load_target("tiny-llama")
    seen = []
    original = type(target).prepare

    def spy(self, prompt, image=None):
        seen.append((prompt, image))
        return original(self, prompt, image)

    monkeypatch.setattr(type(target), "prepare", spy)
    _bench(_config(tmp_path))
    rows = {(r["unit"], r["method"]): r for r in ResultsFile(tmp_path / "out").load()}
    second = [messages for messages, _ in seen if messages[-1]["content"] == "Now say it shorter."]
    assert len(second) == 1 and len(seen) == 4          # prepared once per unit, shared by every method
    answer = rows[("m1#0", "ar")]["text"]
    assert answer == load_target("tiny-llama").tokenizer.decode(rows[("m1#0", "ar")]["tokens"],
                                                                skip_special_tokens=True).strip()
    assert second[0][1:4] == [{"role": "user", "content": "Describe the picture."},
                              {"role": "assistant", "content": answer},
                              {"role": "user", "content": "Now say it shorter."}]
    assert all(image is None for _, image in seen)


def test_a_vision_language_model_gets_the_image(tmp_path):
    _bench(_config(tmp_path, model="tiny-qwen2.5-vl", topics=["alpha"], limit=1), model="tiny-qwen2.5-vl")
    rows = ResultsFile(tmp_path / "out").load()
    assert len(rows) == 2 and all(r["has_image"] for r in rows) and all(r["identical"] for r in rows)
    assert rows[0]["prompt_tokens"] > 20   # the image placeholders are in the prompt
    report = (tmp_path / "out" / "report.md").read_text()
    assert "the model takes images" in report


def _counting_decode(monkeypatch, fail_at: int | None = None) -> list:
    calls = []
    real = bench_runner.decode

    def counted(*args, **kwargs):
        calls.append(1)
        if fail_at is not None and len(calls) == fail_at:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_runner, "decode", counted)
    return calls


def test_interrupted_run_resumes_without_redoing_finished_units(tmp_path, monkeypatch):
    config = _config(tmp_path, methods="recap,pld", warmup=True)
    labels = 3
    # warm-up (3 decodes), unit a1 (3), then Ctrl-C in the second decode of unit a2
    calls = _counting_decode(monkeypatch, fail_at=labels + labels + 2)
    run = _bench(config)
    assert run.interrupted and run.units_run == 1
    rows = ResultsFile(tmp_path / "out").load()
    assert [r["unit"] for r in rows] == ["a1#0"] * labels   # whole units only, valid JSON
    assert not (tmp_path / "out" / "summary.json").exists()

    monkeypatch.undo()
    calls = _counting_decode(monkeypatch)
    run = _bench(config)
    assert not run.interrupted and run.units_run == 3
    assert len(calls) == labels + 3 * labels               # warm-up + the three units left, nothing redone
    rows = ResultsFile(tmp_path / "out").load()
    assert len(rows) == 4 * labels and len({(r["unit"], r["method"]) for r in rows}) == len(rows)
    record = json.loads((tmp_path / "out" / "run.json").read_text())
    assert [s["units_done_before"] for s in record["sessions"]] == [0, 1]
    assert record["sessions"][1]["stream_events"] == [
        {"topic": "alpha", "method": "recap", "event": "restored", "after_unit": "a1#0"}]
    by_key = {(r["unit"], r["method"]): r for r in rows}
    assert by_key[("a2#0", "recap")]["stream"] == "restored" and by_key[("m1#0", "recap")]["stream"] == "fresh"
    assert by_key[("m1#1", "recap")]["stream"] == "carried" and by_key[("a2#0", "pld")]["stream"] == "none"
    assert "recap in alpha restored after a1#0" in (tmp_path / "out" / "report.md").read_text()

    monkeypatch.undo()
    calls = _counting_decode(monkeypatch)
    run = _bench(config)
    assert len(calls) == 0 and run.units_run == 0 and len(ResultsFile(tmp_path / "out").load()) == 4 * labels


def test_resume_refuses_other_settings(tmp_path):
    _bench(_config(tmp_path, topics=["alpha"], limit=1))
    with pytest.raises(InputError, match="max_new_tokens 6 -> 7"):
        _bench(_config(tmp_path, topics=["alpha"], limit=1, max_new_tokens=TOKENS + 1))


def test_ctrl_c_during_a_write_waits_for_the_write(tmp_path):
    import os
    import signal

    from recap.bench.results import interrupts_held

    done = []
    # Background jobs start with SIGINT ignored: install Python's handler for this test.
    original = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("after the signal")
        assert done == ["after the signal"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, original)


def test_a_torn_last_line_is_dropped(tmp_path):
    results = ResultsFile(tmp_path)
    results.append([{"unit": "a", "method": "ar"}, {"unit": "a", "method": "pld"}])
    with open(results.path, "a") as handle:
        handle.write('{"unit": "b", "meth')
    assert [r["unit"] for r in results.load()] == ["a", "a"]
    assert results.path.read_text().endswith("}\n")
    with open(results.path, "a") as handle:
        handle.write("garbage\n")
    with pytest.raises(InputError, match="damaged"):
        results.load()


class _StatefulDrafter(BaseProposer):
    """Keeps state across requests but cannot save it: a resume must restart it cold."""

    name = "stateful"
    stream_state = True

    def reset_stream(self) -> None:
        pass


def test_checkpoints_restore_recap_and_restart_the_rest(tmp_path):
    target = load_target("tiny-llama")
    inputs = target.prepare("Tell me about the sea and the sea again.")
    from recap.decoding import decode

    live = RecapProposer()
    decode(target, live, inputs, max_new_tokens=8)
    checkpoints = StreamCheckpoints(tmp_path, "alpha")
    checkpoints.save({"recap": live, "stateful": _StatefulDrafter()}, "u#0")
    restored, cold = RecapProposer(), RecapProposer()
    assert checkpoints.restore("recap", restored, "u#1") == "restarted"       # checkpoint of another unit
    assert checkpoints.restore("recap", restored, "u#0") == "restored"
    assert checkpoints.restore("stateful", _StatefulDrafter(), "u#0") == "restarted"
    assert checkpoints.restore("pld", PROPOSERS["pld"](), "u#0") == "none"
    assert checkpoints.restore("tree-recycling", PROPOSERS["tree-recycling"](), "u#0") == "none"  # request-local
    prompt_rows, _ = target.prefill(inputs)
    target.release()
    for proposer in (live, restored, cold):
        proposer.begin_request(prompt_rows)
    keys, ids, probs = live.memory.unigram_arrays()
    keys_r, ids_r, probs_r = restored.memory.unigram_arrays()
    assert np.array_equal(keys, keys_r) and np.array_equal(ids, ids_r)
    assert np.allclose(probs, probs_r, atol=1e-6)
    assert len(cold.memory.unigram_arrays()[0]) < len(keys)                  # a cold stream would differ


class _EagerDrafter(BaseProposer):
    """Always drafts a three-token chain (the last token repeated)."""

    name = "eager"

    def propose(self, history, limits=None):
        return DraftTree([history[-1]] * 3, [-1, 0, 1])


def test_mismatches_are_counted_and_shown_loudly(tmp_path, monkeypatch):
    monkeypatch.setitem(PROPOSERS, "eager", _EagerDrafter)
    monkeypatch.setattr(acceptance, "greedy", first_child_walk)
    run = _bench(_config(tmp_path, methods="eager,pld", topics=["alpha"]))
    eager = run.summary["methods"]["eager"]
    assert eager["mismatches"] == 2 and run.summary["mismatches"] >= 2
    assert {m["unit"] for m in eager["mismatched_units"]} == {"a1#0", "a2#0"}
    report = (tmp_path / "out" / "report.md").read_text()
    assert report.splitlines()[2].startswith("> **MISMATCH:") and "losslessness" in report
    assert "**eager**: 2 of 2 units differ" in report


def test_a_numba_compile_inside_a_timed_decode_is_recorded_and_flagged(tmp_path, monkeypatch):
    """A decode that compiles numba code (a cold cache, a kernel edited since the last run)
    has the compile inside its time: the row records it and the report flags the run. The
    other decodes, on compiled code, record none (the watch sees only real compiles)."""
    import numba

    real = bench_runner.decode
    compiled = []

    def compiling(target, proposer, *args, **kwargs):
        if getattr(proposer, "name", "") == "pld" and not compiled:  # pld's first unit only
            fresh = numba.njit(lambda x: x + 1)  # a new function: in no cache
            compiled.append(fresh(1))
        return real(target, proposer, *args, **kwargs)

    # the same units once first: on a cold numba cache (a clean clone) their first run compiles the kernels
    _bench(_config(tmp_path, methods="pld", topics=["alpha"], out=tmp_path / "warm"))
    monkeypatch.setattr(bench_runner, "decode", compiling)
    run = _bench(_config(tmp_path, methods="pld", topics=["alpha"]))
    rows = ResultsFile(tmp_path / "out").load()
    flagged = [row for row in rows if row["compiles"]]
    assert len(rows) == 4 and len(flagged) == 1 and flagged[0]["method"] == "pld"
    assert flagged[0]["compile_s"] > 0 and flagged[0]["compiled"] == ["test_a_numba_compile_inside_a_timed_decode_"
                                                                        "is_recorded_and_flagged.<locals>.compiling."
                                                                        "<locals>.<lambda>"]
    assert all(row["compile_s"] == 0 for row in rows if row is not flagged[0])
    assert run.summary["compiled_units"] == [{"unit": flagged[0]["unit"], "method": "pld", "compiles": 1,
                                              "compile_s": flagged[0]["compile_s"]}]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "**Compiles inside timing**: numba compiled code inside 1 timed decode(s)" in report
    assert f"pld on {flagged[0]['unit']}" in report


def test_a_run_on_compiled_code_is_not_flagged(tmp_path):
    """The same units again in the same process: everything they run is compiled already."""
    _bench(_config(tmp_path, methods="pld", topics=["alpha"]))
    run = _bench(_config(tmp_path, methods="pld", topics=["alpha"], out=tmp_path / "again"))
    assert run.summary["compiled_units"] == [] and all(row["compiles"] == 0 for row in run.rows)
    assert "Compiles inside timing" not in (tmp_path / "again" / "report.md").read_text()


# --------------------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize(("arguments", "message"), [
    (["--data", "/nonexistent/mm"], "data not found"),
    (["--methods", "decoy"], "unknown method 'decoy'"),
    (["--methods", "warp-drive"], "unknown method 'warp-drive'"),
    (["--topics", "astronomy"], "unknown topic 'astronomy'"),
    (["--limit", "some"], "--limit takes a whole number"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
])
def test_cli_bad_input_is_one_line_with_status_2(tmp_path, capsys, arguments, message):
    folder = write_dataset(tmp_path / "mm")
    argv = ["bench", "--model", "tiny-llama", "--data", str(folder), "--out", str(tmp_path / "out"), *arguments]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_cli_bad_row_and_missing_image(tmp_path, capsys):
    folder = write_dataset(tmp_path / "mm")
    (folder / "images" / "a1.png").unlink()
    argv = ["bench", "--model", "tiny-llava-next", "--data", f"mmspec={folder}", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "image of item a1 not found" in err
    with open(folder / "mmspec.jsonl", "a") as handle:
        handle.write('{"id": "z", "topic": "alpha", "turns": "not a list"}\n')
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mmspec.jsonl:4: field 'turns'" in err


def test_cli_runs_and_rewrites_the_report(tmp_path, capsys):
    folder = write_dataset(tmp_path / "mm")
    out = tmp_path / "out"
    argv = ["bench", "--model", "tiny-llama", "--methods", "pld", "--data", str(folder), "--out", str(out),
            "--topics", "alpha", "--limit", "all", "--max-new-tokens", "4", "--no-warmup"]
    assert main(argv) == 0
    assert "pld: S" in capsys.readouterr().out
    (out / "report.md").unlink()
    assert main(["bench", "--out", str(out), "--report-only"]) == 0
    assert (out / "report.md").is_file()


def test_a_sampled_bench_keeps_every_method_identical_to_ar(tmp_path):
    _bench(_config(tmp_path, methods="pld,recap", temperature=0.8, top_k=20))
    rows = ResultsFile(tmp_path / "out").load()
    assert rows and all(row["identical"] for row in rows)  # one seed per unit, shared by every method
    greedy = tmp_path / "greedy"
    _bench(_config(tmp_path, methods="pld", out=greedy))
    sampled_ar = {r["unit"]: r["tokens"] for r in rows if r["method"] == "ar"}
    greedy_ar = {r["unit"]: r["tokens"] for r in ResultsFile(greedy).load() if r["method"] == "ar"}
    assert sampled_ar != greedy_ar
    record = json.loads((tmp_path / "out" / "run.json").read_text())
    assert record["settings"]["sampling"] == {"temperature": 0.8, "top_k": 20, "top_p": None}


def _record_decodes(monkeypatch, setting: str) -> list[tuple[str, str]]:
    """The bench's decodes as they happen: (proposer class, the target's ``setting`` then)."""
    seen = []
    real_decode = bench_runner.decode

    def recording(target, proposer, inputs, **kwargs):
        seen.append((type(proposer).__name__, getattr(target, setting)))
        return real_decode(target, proposer, inputs, **kwargs)

    monkeypatch.setattr(bench_runner, "decode", recording)
    return seen


def test_reference_stock_runs_ar_on_stock_kernels_and_counts_agreement_only(tmp_path, monkeypatch):
    seen = _record_decodes(monkeypatch, "kernels")
    target = load_target("tiny-llama")
    assert target.kernels == "fast"
    run_bench(_config(tmp_path, reference="stock"), target=target, progress=False)
    assert target.kernels == "fast"  # switched back after every ar-stock decode
    ar = "AutoregressiveProposer"
    assert {kernels for name, kernels in seen if name == ar} == {"fast", "stock"}
    assert {kernels for name, kernels in seen if name != ar} == {"fast"}
    out = tmp_path / "out"
    rows = ResultsFile(out).load()
    assert {r["method"] for r in rows} == {"ar", "ar-stock", "pld"}
    # A stock output that differs from fast AR is an agreement figure, not a mismatch.
    summary = _as_if_different(out, "ar-stock", first_difference=3)
    assert summary["mismatches"] == 0 and summary["methods"]["ar-stock"]["mismatches"] == 4
    report = (out / "report.md").read_text()
    assert "0 of 4 outputs identical" in report and "MISMATCH" not in report
    assert "fast kernels" in report


def _as_if_different(out, method: str, first_difference: int) -> dict:
    """Rewrite a finished run as if every ``method`` output had differed from AR's at
    ``first_difference``, rebuild its outputs, and return the new summary."""
    from recap.bench.report import load_run, write_outputs

    rows = ResultsFile(out).load()
    for row in rows:
        if row["method"] == method:
            row["identical"], row["first_difference"] = False, first_difference
    (out / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    write_outputs(out, *load_run(out))
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_reference_float_pairs_ar_on_the_float_weights_and_counts_a_difference(tmp_path, monkeypatch):
    """``--reference float`` on a model read as GGUF blocks: ``ar-float`` decodes on the float
    weights (the target switches, then back), its outputs equal AR's on the blocks, and a
    difference would be a mismatch (it fails the run), unlike ``ar-stock``'s."""

    seen = _record_decodes(monkeypatch, "weights")
    target = recap.load("smollm2-135m")  # its own: the float decoder it gains stays with it
    assert target.weights == "stored"
    run_bench(_config(tmp_path, model="smollm2-135m", reference="float", limit=1), target=target, progress=False)
    assert target.weights == "stored"  # switched back after every ar-float decode
    ar = "AutoregressiveProposer"
    assert {weights for name, weights in seen if name == ar} == {"stored", "float"}
    assert {weights for name, weights in seen if name != ar} == {"stored"}
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mismatches"] == 0 and summary["methods"]["ar-float"]["units"] >= 1
    assert "`ar-float` is plain AR on the model's float weights" in (out / "report.md").read_text()
    assert _as_if_different(out, "ar-float", first_difference=2)["mismatches"] >= 1


def test_repeats_time_every_unit_in_rounds_from_the_same_state(tmp_path, monkeypatch):
    """``--repeats 3``: every (unit, method) decodes three times; each later round starts from
    the stream and the prefix cache as they stood before the unit (the same output-store
    length, the same prompt rows reused), the stream carried on is the first round's, and a
    row is the round of median time, its times all recorded."""
    target = load_target("tiny-llama")
    seen: list[dict] = []
    real = bench_runner.decode
    rounds_seen: dict[str, int] = {}
    fake_times = (0.3, 0.1, 0.2)  # a (unit, method)'s rounds: the third is the median

    def recorded(target_, proposer, inputs, **kwargs):
        cache = target_.prefix_cache
        reused = cache.reused_tokens
        store = getattr(proposer, "store", None)
        entry = {"scope": target_.prefix_scope, "proposer": id(proposer),
                 "stored": None if store is None else len(store)}
        result = real(target_, proposer, inputs, **kwargs)
        entry["reused"] = cache.reused_tokens - reused
        count = rounds_seen[entry["scope"]] = rounds_seen.get(entry["scope"], -1) + 1
        result.total_s = fake_times[count % 3]
        seen.append(entry)
        return result

    monkeypatch.setattr(bench_runner, "decode", recorded)
    run = run_bench(_config(tmp_path, methods="recap,pld", topics=["alpha"], repeats=3), target=target,
                    progress=False)
    rows = ResultsFile(tmp_path / "out").load()
    assert len(seen) == 2 * 3 * 3 and len(rows) == 2 * 3
    by_unit = [seen[i:i + 9] for i in range(0, len(seen), 9)]
    for calls in by_unit:
        for label in ("ar", "recap", "pld"):
            mine = [c for c in calls if c["scope"] == label]
            assert len(mine) == 3
            assert len({c["reused"] for c in mine}) == 1      # every round met the same prefix cache
            assert len({c["stored"] for c in mine}) == 1      # ... and the same stream state
            assert len({c["proposer"] for c in mine}) == 3    # later rounds decode copies
    recap_first = [next(c for c in calls if c["scope"] == "recap") for calls in by_unit]
    assert recap_first[1]["stored"] > recap_first[0]["stored"]  # the carried stream grew once a unit
    assert sum(c["reused"] for c in seen) > 0                    # the second unit reused the shared prefix
    for row in rows:
        assert row["round_times_s"] == [0.3, 0.1, 0.2] and row["round_kept"] == 2 and row["time_s"] == 0.2
        assert row["identical"]
    summary = run.summary
    assert summary["methods"]["recap"]["round_spread"] == pytest.approx(1.0)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "decoded in 3 rounds" in report and "recap 100%" in report
    with pytest.raises(InputError, match="repeats 3 -> None"):
        _bench(_config(tmp_path, methods="recap,pld", topics=["alpha"]))


def test_a_difference_in_any_round_is_a_mismatch(tmp_path, monkeypatch):
    """A row keeps one round's times, but every round's output is compared with AR's."""
    real = bench_runner.decode
    calls = {"pld": 0}

    def second_round_wrong(target_, proposer, inputs, **kwargs):
        result = real(target_, proposer, inputs, **kwargs)
        if target_.prefix_scope == "pld":
            calls["pld"] += 1
            if calls["pld"] == 2:
                result.tokens = [result.tokens[0], result.tokens[1] + 1, *result.tokens[2:]]
                result.total_s = 1e9  # the slowest round: never the one kept
        return result

    monkeypatch.setattr(bench_runner, "decode", second_round_wrong)
    run = _bench(_config(tmp_path, methods="pld", topics=["alpha"], limit=1, repeats=3))
    pld = run.summary["methods"]["pld"]
    assert pld["mismatches"] == 1 and pld["mismatched_units"] == [{"unit": "a1#0", "first_difference": 1}]


def test_repeats_must_be_positive(tmp_path):
    with pytest.raises(InputError, match="--repeats must be at least 1"):
        _bench(_config(tmp_path, repeats=0))


def test_a_compile_is_recorded_in_the_row_whose_round_is_kept(tmp_path, monkeypatch):
    """With rounds, a row's compile fields are those of the round whose time it reports: a
    compile in a slower round left out is not counted; one in the kept round is."""
    import numba

    real = bench_runner.decode
    calls = {"pld": 0}

    def slowest_round(x):
        return x + 1

    def kept_round(x):
        return x + 2

    def compiling(target_, proposer, inputs, **kwargs):
        result = real(target_, proposer, inputs, **kwargs)
        if target_.prefix_scope == "pld":
            calls["pld"] += 1
            if calls["pld"] in (1, 3):  # fresh functions: in no cache
                numba.njit(slowest_round if calls["pld"] == 1 else kept_round)(1)
            result.total_s = {1: 0.3, 2: 0.1, 3: 0.2}.get(calls["pld"], result.total_s)
        return result

    _bench(_config(tmp_path, methods="pld", topics=["alpha"], limit=1, out=tmp_path / "warm"))  # a warm cache
    monkeypatch.setattr(bench_runner, "decode", compiling)
    _bench(_config(tmp_path, methods="pld", topics=["alpha"], limit=1, repeats=3))
    rows = ResultsFile(tmp_path / "out").load()
    pld = next(row for row in rows if row["method"] == "pld")
    assert pld["round_kept"] == 2 and pld["compiles"] == 1
    assert [name.rsplit(".", 1)[-1] for name in pld["compiled"]] == ["kept_round"]
    assert all(row["compiles"] == 0 for row in rows if row is not pld)
