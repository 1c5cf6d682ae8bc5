"""Shared fixtures: models are loaded once per test session (float32 unless a test says).

Every test runs apart from this machine's caches and from the tests before it:

- ``RECAP_CACHE`` is a temporary folder per session (per xdist worker), so no test reads or
  writes the real ``~/.cache/recap`` (cost profiles, bench data); the built-in models are
  still read from where they were built (``RECAP_MODEL_CACHE``, set to the real cache).
- Every decode runs under `fixed_cost_profile` (a CPU-like curve without online correction)
  unless the test passes its own: the session's targets get a fresh copy before each test,
  and any automatic profile (`recap.verifier.profile.load_or_measure`: what ``--cost-profile
  auto``, `recap.hf` and `recap serve` fall back to) is that curve instead of a measurement
  of this machine. Tests of the profile machinery itself are marked ``measured_cost_profile``.

And every test that claims losslessness with drafting (its name says ``lossless``, or it is
marked ``lossless``) must assert accepted drafts (`tests.helpers.assert_drafted`), or fails;
``no_accepted_drafts`` marks, with a reason, those that check only the rejection path.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile

import pytest
import torch

import recap
from recap import models
from recap.core import CostProfile
from recap.verifier import profile as profiles
from tests import helpers

CHUNKED_IMAGE_MODELS = ["tiny-qwen2.5-vl", "tiny-llava-next"]
"""VLMs whose image rows the fast kernels prefill in chunks, as one-token steps (Gemma 3's
see each other both ways: transformers prefills them, `causal_images`)."""
TINY_VISION_MODELS = [*CHUNKED_IMAGE_MODELS, "tiny-gemma3-vl"]
TINY_MODELS = ["tiny-llama", "tiny-gemma3", *TINY_VISION_MODELS]

_session_cache: str | None = None


def pytest_configure(config):
    # Before any test (or any subprocess a test starts) looks at the cache folders.
    global _session_cache
    os.environ["RECAP_MODEL_CACHE"] = str(models.model_cache_dir())
    _session_cache = tempfile.mkdtemp(prefix="recap-test-cache-")
    os.environ["RECAP_CACHE"] = _session_cache
    config.addinivalue_line("markers", "measured_cost_profile: a test of cost-profile measurement and caching "
                                       "(the lazy profile path is left real; RECAP_CACHE is still temporary)")
    config.addinivalue_line("markers", "lossless: claims losslessness with drafting, so it must call "
                                       "tests.helpers.assert_drafted (implied by 'lossless' in the test's name)")
    config.addinivalue_line("markers", "no_accepted_drafts(reason): a losslessness test of the rejection path only")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test claiming losslessness with drafting fails unless it asserted accepted drafts."""
    claims = "lossless" in getattr(item, "originalname", item.name) or item.get_closest_marker("lossless")
    exempt = item.get_closest_marker("no_accepted_drafts")
    before = helpers.assert_drafted_calls
    result = yield
    if claims and not exempt and helpers.assert_drafted_calls == before:
        raise AssertionError(f"{item.name} claims losslessness with drafting but never asserted that drafts were "
                             "accepted: call tests.helpers.assert_drafted (or mark it no_accepted_drafts(reason))")
    return result


def pytest_unconfigure(config):
    if _session_cache is not None:
        shutil.rmtree(_session_cache, ignore_errors=True)


def fixed_cost_profile() -> CostProfile:
    """t(N) = 1 + 0.06 (N - 1) (t(64) ~ 4.8 t(1), SmolLM2 fp32 on a 2-core CPU) and no online
    correction: tree sizes never depend on this machine, its load or the tests before."""
    return CostProfile.linear(0.06)


_LOADED: dict[tuple[str, str, str], recap.TargetModel] = {}


@functools.cache
def load_target(name: str, dtype: str = "float32", kernels: str = "auto") -> recap.TargetModel:
    """Default kernels: the fast path on these CPU models (lossless against plain decoding on
    the same kernels); ``stock`` for tests of transformers' own forward."""
    target = recap.load(name, dtype=dtype, kernels=kernels)
    target.use_cost_profile(fixed_cost_profile())
    _LOADED[name, dtype, kernels] = target
    return target


@pytest.fixture(autouse=True)
def _fixed_cost_profiles(request, monkeypatch):
    """A fresh fixed profile on every session target; no lazy measurement unless marked."""
    for target in _LOADED.values():
        target.use_cost_profile(fixed_cost_profile())
    if request.node.get_closest_marker("measured_cost_profile") is None:
        monkeypatch.setattr(profiles, "load_or_measure", lambda target, *, quiet=False: fixed_cost_profile())


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    # Two cores: one thread per process keeps timings calm and tests deterministic.
    torch.set_num_threads(1)


@pytest.fixture(params=TINY_MODELS)
def tiny_target(request) -> recap.TargetModel:
    return load_target(request.param)


@pytest.fixture(params=TINY_MODELS)
def tiny_stock_target(request) -> recap.TargetModel:
    return load_target(request.param, kernels="stock")


@pytest.fixture
def tiny_llama() -> recap.TargetModel:
    return load_target("tiny-llama")


@pytest.fixture
def tiny_qwen() -> recap.TargetModel:
    return load_target("tiny-qwen2.5-vl")


@pytest.fixture
def smollm2() -> recap.TargetModel:
    return load_target("smollm2-135m")
