"""Verify-cost profiles: the numpy model, its cache (keys, corrupt and stale files), the
measurement on the tiny models and the CLI. No wall-clock thresholds: timings only have to
be positive and finite."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import recap
from recap.cli import main
from recap.core import CostProfile, DraftTree, ProfileError
from recap.errors import InputError
from recap.proposers.base import BaseProposer
from recap.verifier import profile as profiles
from tests.conftest import TINY_MODELS, load_target

pytestmark = pytest.mark.measured_cost_profile  # the lazy profile path is what these tests test

SMALL = {"sizes": (1, 2, 4), "contexts": (8, 24), "repeats": 1}
"""A grid that measures in well under a second on the tiny models."""


def fresh(name: str = "tiny-llama", dtype: str = "float32") -> recap.TargetModel:
    """A new adapter over the session's cached weights: profiles set here do not leak."""
    shared = load_target(name, dtype)
    return recap.wrap(shared.model, shared.processor)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty RECAP_CACHE of the test's own (the built models stay in RECAP_MODEL_CACHE)."""
    monkeypatch.setenv("RECAP_CACHE", str(tmp_path))
    assert Path(load_target("tiny-llama").name).parent != tmp_path
    return tmp_path


@pytest.fixture
def measured(monkeypatch) -> list[str]:
    """Record (and shrink) every measurement the lazy path makes."""
    calls: list[str] = []
    real = profiles.measure_profile

    def small(target, **_options):
        calls.append(target.name)
        return real(target, **SMALL)

    monkeypatch.setattr(profiles, "measure_profile", small)
    return calls


# --------------------------------------------------------------------------- the numpy model
def grid() -> CostProfile:
    return CostProfile(sizes=[1, 4], contexts=[0, 100], times=[[1.0, 4.0], [2.0, 8.0]], key={"model": "m"})


def test_interpolates_in_size_and_context():
    profile = grid()
    assert profile.predict(2, 0) == pytest.approx(2.0)
    assert profile.predict(4, 50) == pytest.approx(6.0)
    assert profile.predict([1, 4], 100) == pytest.approx([2.0, 8.0])
    assert profile.relative(4, 0) == pytest.approx(4.0)


def test_extrapolates_beyond_the_grid():
    profile = grid()
    assert profile.predict(8, 0) == pytest.approx(8.0)  # the last segment's slope continues
    assert profile.predict(1, 200) == pytest.approx(3.0)  # the two contexts' slope continues
    assert profile.predict(1, -100) >= 1.0  # never below the smaller of the nearest rows


def test_flat_costs_the_same_at_every_size():
    flat = CostProfile.flat()
    assert flat.relative([1, 2, 64, 500], 4000) == pytest.approx([1, 1, 1, 1])
    flat.observe(64, 0, 100.0)  # a flat profile does not learn
    assert flat.relative(64) == pytest.approx(1.0)


def test_json_round_trip():
    profile = grid()
    again = CostProfile.from_json(profile.to_json())
    assert again.key == profile.key and again.source == profile.source
    np.testing.assert_array_equal(again.times, profile.times)
    np.testing.assert_array_equal(again.sizes, profile.sizes)
    np.testing.assert_array_equal(again.contexts, profile.contexts)


@pytest.mark.parametrize("text", [
    "not json", "[]", "{}", json.dumps({"version": 0}),
    json.dumps({"version": 1, "key": {}, "sizes": [1, 2], "contexts": [0], "times": [[1.0]]}),
    json.dumps({"version": 1, "key": {}, "sizes": [1, 2], "contexts": [0], "times": [[1.0, -1.0]]}),
    json.dumps({"version": 1, "key": {}, "sizes": [2, 1], "contexts": [0], "times": [[1.0, 2.0]]}),
    json.dumps({"version": 1, "sizes": [1], "contexts": [0], "times": [[1.0]]}),
])
def test_garbage_is_a_profile_error(text):
    with pytest.raises(ProfileError):
        CostProfile.from_json(text)


def test_a_blocked_profile_is_a_staircase():
    # The fast kernels compute 33..36 packed tokens as 36 rows: a grid point at 33 prices
    # the whole block, and the next block starts at 37 (interpolated towards 48, the next
    # point's block). Without blocks the same grid is a straight line from 33 to 48.
    grid = dict(sizes=[1, 2, 4, 5, 33, 48], contexts=[0], times=[[1.0, 1.1, 1.2, 1.6, 5.0, 8.0]])
    blocked, plain = CostProfile(**grid, row_block=4), CostProfile(**grid)
    assert blocked.predict([33, 34, 35, 36]) == pytest.approx([5.0] * 4)
    assert blocked.predict([37, 40]) == pytest.approx([6.0, 6.0])  # 40 rows: a third of 36 -> 48
    assert blocked.predict([1, 2, 3, 4, 5, 8]) == pytest.approx([1.0, 1.1, 1.2, 1.2, 1.6, 1.6])
    assert plain.predict(36) == pytest.approx(5.6) and plain.predict(3) == pytest.approx(1.15)
    again = CostProfile.from_json(blocked.to_json())
    assert again.row_block == 4 and again.predict(35) == pytest.approx(5.0)
    with pytest.raises(ProfileError):
        CostProfile(**grid, row_block=0)


def test_profiles_of_the_fast_kernels_are_blocked(tmp_path):
    # A file saved before the field existed is read as blocked when it was measured on the
    # fast kernels (their padding is what the staircase is), as a plain grid otherwise.
    for kernels, block in (("fast", 4), ("stock", 1)):
        data = grid().to_dict()
        data.pop("row_block")
        data["key"] = {"kernels": kernels}
        path = tmp_path / f"{kernels}.json"
        path.write_text(json.dumps(data))
        assert profiles.read_profile(path).row_block == block


def test_observe_moves_the_prediction_towards_observed_times():
    profile = CostProfile(sizes=[1, 8, 64], contexts=[0], times=[[1.0, 2.0, 5.0]])
    for _ in range(30):
        profile.observe(8, 0, 4.0)
    assert 2.0 < profile.predict(8) <= 4.0
    assert profile.predict(1) == pytest.approx(1.0)  # other sizes keep their measured times


# --------------------------------------------------------------------------- keys and the cache
def test_key_follows_dtype_and_threads(monkeypatch):
    key = profiles.profile_key(fresh())
    assert key == profiles.profile_key(fresh())
    assert profiles.profile_key(fresh(dtype="bfloat16"))["dtype"] == "bfloat16"
    assert profiles.profile_path(profiles.profile_key(fresh(dtype="bfloat16"))) != profiles.profile_path(key)
    target = fresh()  # built first: building warms the kernels, which set torch's count back to what
    # get_num_threads says, and a patched getter would leak into the real setting (and later tests)
    monkeypatch.setattr(torch, "get_num_threads", lambda: key["threads"] + 1)
    other = profiles.profile_key(target)
    assert other["threads"] == key["threads"] + 1
    assert profiles.profile_path(other) != profiles.profile_path(key)


def test_profile_path_is_stable_for_equal_keys(cache):
    key = {"model": "m", "threads": 1, "dtype": "float32"}
    path = profiles.profile_path(key)
    assert path == profiles.profile_path(dict(reversed(list(key.items()))))
    assert path.parent == cache / "profiles" and path.suffix == ".json"


def test_missing_profile_is_measured_once_and_cached(cache, measured, capsys):
    target = fresh()
    first = target.verify_cost()
    assert target.verify_cost() is first and measured == [target.name]
    assert profiles.profile_path(profiles.profile_key(target)).exists()
    assert profiles.load_or_measure(fresh()).key == first.key and len(measured) == 1  # read from the cache
    assert len(capsys.readouterr().err.strip().splitlines()) == 1  # one note while measuring


@pytest.mark.parametrize("content", [b"{ not json", b"\xff\xfe\x00", json.dumps({"version": 0}).encode(), b""])
def test_corrupt_or_old_profile_warns_once_and_is_remeasured(cache, measured, capsys, content):
    target = fresh()
    path = profiles.profile_path(profiles.profile_key(target))
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    profile = profiles.load_or_measure(target)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warning" in err[0] and str(path) in err[0]
    assert measured == [target.name] and profile.key == profiles.profile_key(target)
    assert profiles.read_profile(path).key == profile.key  # replaced by the new measurement


def test_profile_of_other_settings_is_remeasured(cache, measured, capsys):
    target = fresh()
    key = profiles.profile_key(target)
    stale = CostProfile.flat()
    stale.key = {**key, "threads": key["threads"] + 7}
    profiles.save_profile(stale, profiles.profile_path(key))
    assert profiles.load_or_measure(target).source == "measured" and len(measured) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "threads" in err[0]


def test_verify_cost_follows_a_thread_change(cache, measured, monkeypatch):
    """A new thread count is a new profile; one the kernels cannot run on (more than numba's
    pool holds) is refused, not measured on fewer threads and labelled with the request."""
    import numba

    from recap.errors import RecapError

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba's pool has one thread here")
    target = fresh()
    target.verify_cost()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert target.verify_cost().key["threads"] == 2 and len(measured) == 2
    too_many = numba.config.NUMBA_NUM_THREADS + 1
    monkeypatch.setattr(torch, "get_num_threads", lambda: too_many)
    with pytest.raises(RecapError, match=f"asked for {too_many} thread"):
        target.verify_cost()


def test_explicit_specs(cache, measured, tmp_path, capsys):
    target = fresh()
    assert profiles.resolve_profile(target, "flat").source == "flat"
    assert target.use_cost_profile("flat").source == "flat"
    assert target.verify_cost().source == "flat" and not measured
    given = CostProfile.linear(0.5)
    assert target.use_cost_profile(given) is given and target.verify_cost() is given
    assert target.use_cost_profile("auto") is None and target.cost_profile is None

    foreign = CostProfile.linear(0.2)
    foreign.key = {"model": "elsewhere"}
    path = profiles.save_profile(foreign, tmp_path / "other-machine.json")
    loaded = target.use_cost_profile(str(path))
    assert loaded.source == "file" and loaded.predict(11) == pytest.approx(foreign.predict(11))
    assert len(capsys.readouterr().err.strip().splitlines()) == 1  # another key only warns
    assert not measured


def test_a_profile_file_is_used_as_given_not_corrected_online(cache, measured, tmp_path):
    """A file stays what it says through a whole decode (choices independent of timing);
    the same curve as a plain profile follows the run's verify times."""
    written = CostProfile.linear(0.3, seconds=5.0)   # 5 s a step: far from any real timing
    written.key = {"model": "elsewhere"}
    path = profiles.save_profile(written, tmp_path / "fixed.json")
    sizes = np.arange(1, 9)
    target = fresh()
    fixed = target.use_cost_profile(str(path))
    recap.decode(target, CostReader(), target.prepare("Hello there."), max_new_tokens=6)
    assert fixed.predict(sizes) == pytest.approx(written.predict(sizes), rel=0, abs=0)
    moving = profiles.read_profile(path)   # control: the same file read as a plain profile
    assert moving.correction_rate > 0
    target.use_cost_profile(moving)
    recap.decode(target, CostReader(), target.prepare("Hello there."), max_new_tokens=6)
    assert moving.predict(1) < written.predict(1)   # ms-long steps pulled the 5 s curve down


def test_explicit_corrupt_or_missing_file_is_an_input_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{]")
    for spec in (bad, tmp_path / "missing.json"):
        with pytest.raises(InputError) as error:
            profiles.resolve_profile(fresh(), spec)
        assert "\n" not in str(error.value)


class CostReader(BaseProposer):
    """A drafter that asks for the cost profile and proposes one node."""

    name = "cost-reader"
    wants_cost = True

    def propose(self, history, limits=None):
        self.seen = limits
        return DraftTree([int(history[-1])], [-1])


def test_decode_asks_the_target_for_its_profile(cache, measured):
    target = fresh()
    proposer = CostReader()
    result = recap.decode(target, proposer, target.prepare("Hello there."), max_new_tokens=4)
    assert len(result.tokens) == 4 and measured == [target.name]
    assert proposer.seen.cost is target.cost_profile and proposer.seen.context_len > 0


# --------------------------------------------------------------------------- measurement
def test_measure_profile_times_every_size():
    target = fresh()
    profile = profiles.measure_profile(target, **SMALL)
    assert profile.times.shape == (2, 3) and profile.source == "measured"
    assert np.all(np.isfinite(profile.times)) and np.all(profile.times > 0)
    assert profile.key == profiles.profile_key(target) and not target.holds_cache
    # the fast kernels' row padding: blocks of 4 rows, or row by row where every layer has remainder blocks
    row_by_row = target.kernels != "fast" or all(linear.remainders for layer in target.decoder.layers
                                                 for linear in layer.linears())
    assert profile.row_block == target.cost_row_block == (1 if row_by_row else 4)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_measure_works_on_every_family_text_only(name):
    target = fresh(name)
    profile = profiles.measure_profile(target, sizes=(1, 5), contexts=(12,), repeats=1)
    assert np.all(profile.times > 0) and profile.contexts.tolist() == [12]
    rows, _ = target.prefill(target.prepare("Still works?"))  # the target is usable afterwards
    assert len(rows.ids) > 0


def test_grid_is_clamped_to_the_context_window():
    target = fresh()
    target.max_context = limit = 40
    profile = profiles.measure_profile(target, sizes=(1, 2, limit + 5), contexts=(16, 10**9), repeats=1)
    assert profile.sizes.tolist() == [1, 2] and profile.contexts.tolist() == [16, limit - 2]
    target.sliding_window = 20
    profile = profiles.measure_profile(target, sizes=(1, 4), contexts=(16, 100), repeats=1)
    assert profile.contexts.tolist() == [16]


# --------------------------------------------------------------------------- command line
@pytest.mark.parametrize("as_json", [False, True])
def test_calibrate_writes_the_cache_and_out(cache, tmp_path, capsys, as_json):
    out = tmp_path / "mine.json"
    assert main(["calibrate", "--model", "tiny-llama", "--quick", "--threads", "1", "--out", str(out),
                 *(["--json"] if as_json else [])]) == 0
    printed = capsys.readouterr().out
    profile = profiles.read_profile(out)
    assert profile.key["threads"] == 1 and np.all(profile.times > 0)
    if as_json:
        assert json.loads(printed)["saved"][1] == str(out)
    else:
        assert str(out) in printed and "x1 @L=" in printed
    cached = list((cache / "profiles").glob("*.json"))
    assert len(cached) == 1 and profiles.read_profile(cached[0]).key == profile.key


def test_bad_cost_profile_file_exits_2_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("garbage")
    assert main(["generate", "--model", "tiny-llama", "--prompt", "Hi.", "--cost-profile", str(bad),
                 "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("recap: error:") and str(bad) in err[0]


def test_flat_cost_profile_on_the_command_line(capsys):
    assert main(["generate", "--model", "tiny-llama", "--prompt", "Hi.", "--cost-profile", "flat",
                 "--max-new-tokens", "2", "--method", "pld"]) == 0
    assert capsys.readouterr().out.strip()


def test_bench_records_and_applies_the_cost_profile(tmp_path):
    from recap.bench.runner import Bench, run_record
    from tests.test_bench import _config

    target = fresh()
    bench = Bench(_config(tmp_path, topics=["alpha"], limit=1, cost_profile="flat"), target=target, progress=False)
    bench.run()
    assert target.cost_profile.source == "flat" and run_record(tmp_path / "out")["settings"]["cost_profile"] == "flat"
    assert Bench(_config(tmp_path, cost_profile="auto"), progress=False).settings()["cost_profile"] is None


def test_a_blocked_profile_averages_a_dip_away():
    # On the fast kernels more rows are more work, so a measured dip (t(36 rows) below
    # t(32 rows), a busy VM's noise) is pooled with its neighbour: the mean of both, not a
    # cheap 33-36 the chooser would aim at. The flat end it leaves does not flatten the
    # extrapolation past the grid.
    grid = dict(sizes=[1, 2, 4, 8, 32, 33, 64], contexts=[0], times=[[1.0, 1.0, 1.1, 1.6, 5.4, 4.9, 8.6]])
    blocked = CostProfile(**grid, row_block=4)
    assert blocked.predict([32, 33, 36]) == pytest.approx([5.15, 5.15, 5.15])
    assert np.all(np.diff(blocked.predict(np.arange(1, 129))) >= 0)
    assert blocked.predict(96) == pytest.approx(8.6 + (8.6 - 5.15) / 28 * 32)
    assert CostProfile(**grid).predict(33) == pytest.approx(4.9)  # stock curves are left as measured
    flat_end = CostProfile(sizes=[1, 8, 32, 64], contexts=[0], times=[[1.0, 2.0, 6.0, 5.0]], row_block=4)
    assert flat_end.predict(64) == pytest.approx(5.5) and flat_end.predict(128) > flat_end.predict(64)
