"""Lossless sampling: drafts change speed, never the distribution (nor, for a seed, a token)."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from recap.core import ROOT, TreeBuilder
from recap.core.cost import CostProfile
from recap.decoding import decode, reference_generate
from recap.images import synthetic_image
from recap.proposers import make_proposer
from recap.proposers.base import BaseProposer
from recap.proposers.testing import DecoyDrafter
from recap.sampling_check import OTHER, check_sampling, exact_prefixes
from recap.verifier import acceptance
from recap.verifier.sampling import Sampler, Sampling, SamplingError
from tests import broken_verifiers
from tests.conftest import TINY_MODELS, load_target
from tests.helpers import assert_drafted

METHODS = ["recap", "recap-paper", "pld", "token-recycling", "tree-recycling", "sam", "sam-viskip", "lookahead"]


def _inputs(target, prompt="Tell me a story about the sea."):
    image = synthetic_image(5, 40, 32) if target.accepts_images else None
    return target.prepare(prompt, image)


# ----------------------------------------------------------------------------- settings
def test_temperature_zero_or_absent_is_greedy_and_bad_values_are_refused():
    assert Sampling.of(None) is None and Sampling.of(0) is None and Sampling.of(0, top_k=4, top_p=0.5) is None
    assert Sampling.of(0.7, top_k=4, seed=3) == Sampling(0.7, 4, None, 3)
    for bad in (dict(temperature=-1.0), dict(temperature=float("nan")), dict(temperature=1e-300),
                dict(temperature=1.0, top_k=-2),
                dict(temperature=1.0, top_p=0.0), dict(temperature=1.0, top_p=1.5)):
        with pytest.raises(SamplingError):
            Sampling(**bad)


@pytest.mark.parametrize("options", [dict(temperature=0.7), dict(temperature=1.0, top_k=4),
                                     dict(temperature=1.3, top_p=0.9), dict(temperature=0.5, top_k=10, top_p=0.8)])
def test_the_processed_distribution_is_the_one_generate_samples_from(options):
    target = load_target("tiny-llama")
    config = GenerationConfig(do_sample=True, temperature=options["temperature"], top_k=options.get("top_k", 0),
                              top_p=options.get("top_p", 1.0))
    theirs = target.model._get_logits_processor(generation_config=config, device="cpu")
    ours = Sampler(Sampling(options["temperature"], options.get("top_k"), options.get("top_p")), 4)
    logits = torch.randn(3, target.vocab_size, dtype=torch.float64) * 3
    expected = torch.softmax(theirs(None, logits.clone()), dim=-1)
    assert torch.allclose(ours.probabilities(logits), expected, atol=1e-12)


# ----------------------------------------------------------------------------- same seed, same tokens
@pytest.mark.lossless
@pytest.mark.parametrize("model", TINY_MODELS)
def test_a_seed_gives_the_same_tokens_with_every_method_and_drafts_are_accepted(model):
    target = load_target(model)
    inputs = _inputs(target)
    sampling = Sampling(0.8, top_k=8, seed=1234)
    reference = decode(target, make_proposer("ar"), inputs, max_new_tokens=24, sampling=sampling).tokens
    assert reference != decode(target, make_proposer("ar"), inputs, max_new_tokens=24,
                               sampling=Sampling(0.8, top_k=8, seed=99)).tokens  # the seed matters
    for method in METHODS:
        proposer = make_proposer(method)
        for _ in range(2):  # the second request can draft from the first
            result = decode(target, proposer, inputs, max_new_tokens=24, sampling=sampling, cost=CostProfile.flat())
            assert result.tokens == reference, method
        if proposer.stream_state:  # (the others draft from the request alone: nothing repeats in it here)
            assert_drafted(result, min_accepted=5)
    decoy = DecoyDrafter(inputs.input_ids[0].tolist() + reference, seed=3)
    result = decode(target, decoy, inputs, max_new_tokens=24, sampling=sampling)
    assert result.tokens == reference
    assert_drafted(result, min_accepted=6)
    recap = make_proposer("recap")
    for _ in range(2):
        result = decode(target, recap, inputs, max_new_tokens=24, sampling=sampling, cost=CostProfile.flat())
    assert result.tokens == reference
    assert_drafted(result, min_accepted=6)


def test_temperature_zero_is_todays_greedy_path():
    from recap.decoding import generate

    target = load_target("tiny-llama")
    greedy = reference_generate(target, target.prepare("Hello there"), 12)
    assert generate(target, "Hello there", method="recap", max_new_tokens=12, temperature=0).tokens == greedy
    assert generate(target, "Hello there", method="pld", max_new_tokens=12, temperature=0.0, top_k=3).tokens == greedy


# ----------------------------------------------------------------------------- distribution
class ModeDrafter(BaseProposer):
    """Drafts the likeliest continuation (one child per level) from the exact prefix table:
    the drafts a biased verifier would favour."""

    name = "mode"

    def __init__(self, probabilities: dict[tuple, float], depth: int):
        self.probabilities, self.depth = probabilities, depth

    def begin_request(self, prompt) -> None:
        self.prompt_len = len(prompt.ids)

    def propose(self, history, limits=None):
        generated = tuple(int(t) for t in history[self.prompt_len:])
        builder, parent = TreeBuilder(), ROOT
        while len(generated) < self.depth:
            options = {k: p for k, p in self.probabilities.items()
                       if k != OTHER and len(k) > len(generated) and k[: len(generated)] == generated}
            if not options:
                break
            best = max(options, key=options.get)[len(generated)]
            parent = builder.add(parent, best)
            generated = (*generated, best)
        return builder.build()


SETTING = Sampling(1.0, top_k=4)


@pytest.fixture(scope="module")
def llama_exact():
    target = load_target("tiny-llama")
    inputs = _inputs(target, "Sample three tokens.")
    return target, inputs, exact_prefixes(target, inputs, SETTING, 3)


def test_the_exact_table_is_a_distribution_over_every_prefix(llama_exact):
    _, _, probabilities = llama_exact
    assert len(probabilities) == 4 ** 3 + 1 and probabilities[OTHER] < 1e-9
    assert sum(probabilities.values()) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("method", ["mode", "recap", "pld", "sam", "lookahead"])
def test_drafting_samples_the_target_distribution(llama_exact, method):
    """(Every method on every tiny architecture: `make check-sampling`.)"""
    target, inputs, probabilities = llama_exact
    proposer = ModeDrafter(probabilities, 3) if method == "mode" else make_proposer(method)
    report = check_sampling(target, proposer, inputs, SETTING, runs=1000 if method in ("mode", "recap") else 600,
                            probabilities=probabilities)
    assert report.passed, report
    if method in ("mode", "recap"):
        assert report.accepted > 200  # the check ran with drafts accepted, not around them


@pytest.mark.parametrize("model", ["tiny-qwen2.5-vl", "tiny-llava-next"])
def test_drafting_samples_the_target_distribution_on_vision_language_models(model):
    target = load_target(model)
    inputs = _inputs(target, "Sample three tokens.")
    probabilities = exact_prefixes(target, inputs, SETTING, 3)
    report = check_sampling(target, ModeDrafter(probabilities, 3), inputs, SETTING, runs=800,
                            probabilities=probabilities)
    assert report.passed and report.accepted > 150, report


@pytest.mark.parametrize("walk", [broken_verifiers.topk_accepting_walk, broken_verifiers.retry_once_walk])
def test_biased_verifiers_are_caught(llama_exact, monkeypatch, walk):
    target, inputs, probabilities = llama_exact
    monkeypatch.setattr(acceptance, "sampled", walk)
    report = check_sampling(target, ModeDrafter(probabilities, 3), inputs, SETTING, runs=1000,
                            probabilities=probabilities)
    assert not report.passed, report
