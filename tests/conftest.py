"""Shared fixtures: models are loaded once per test session (float32 unless a test says)."""

from __future__ import annotations

import functools

import pytest
import torch

import recap

TINY_MODELS = ["tiny-llama", "tiny-qwen2.5-vl", "tiny-llava-next"]


@functools.cache
def load_target(name: str, dtype: str = "float32", kernels: str = "auto") -> recap.TargetModel:
    """Default kernels: the fast path on these CPU models (lossless against plain decoding on
    the same kernels); ``stock`` for tests of transformers' own forward."""
    return recap.load(name, dtype=dtype, kernels=kernels)


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
