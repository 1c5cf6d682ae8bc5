"""The decoding loop as a step iterator: the same tokens as `decode`, cleanup on every exit."""

import pytest

from recap.core.cost import CostProfile
from recap.decoding import Decoding, decode
from recap.errors import InputError
from recap.proposers import make_proposer
from tests.helpers import assert_drafted


def _repeated(target, proposer, prompt, max_new_tokens=24):
    """The same request twice in one stream, so the second one drafts from the first."""
    inputs = target.prepare(prompt)
    decode(target, proposer, inputs, max_new_tokens=max_new_tokens, cost=CostProfile.flat())
    return Decoding(target, proposer, inputs, max_new_tokens=max_new_tokens, cost=CostProfile.flat())


@pytest.mark.lossless
def test_steps_add_up_to_decode_and_mark_drafted_tokens(tiny_llama):
    prompt = "Count: one two three four five six seven eight nine ten eleven twelve."
    reference = decode(tiny_llama, make_proposer("ar"), tiny_llama.prepare(prompt), max_new_tokens=24).tokens
    decoding = _repeated(tiny_llama, make_proposer("recap"), prompt)
    steps = list(decoding)
    assert [t for step in steps for t in step.tokens] == reference == decoding.result.tokens
    assert steps[0].iteration is None and steps[0].drafted == 0 and len(steps[0].tokens) == 1
    assert all(step.drafted <= len(step.tokens) for step in steps)
    assert_drafted(decoding.result, min_accepted=10)  # the second run replays the first
    assert sum(step.drafted for step in steps) > 0
    assert sum(step.drafted for step in steps) <= sum(it.accepted for it in decoding.result.iterations)
    assert decoding.result.total_s > 0


def test_leaving_early_frees_the_cache_and_ends_the_request(tiny_llama):
    proposer = make_proposer("recap")
    decoding = Decoding(tiny_llama, proposer, tiny_llama.prepare("Tell me a long story."), max_new_tokens=32)
    steps = iter(decoding)
    next(steps)
    next(steps)
    assert tiny_llama.holds_cache
    steps.close()  # what a cancelled request does
    assert not tiny_llama.holds_cache
    assert len(decoding.result.tokens) >= 2 and decoding.result.total_s > 0
    # the stream goes on normally afterwards
    assert decode(tiny_llama, proposer, tiny_llama.prepare("Hello"), max_new_tokens=4).tokens


def test_an_error_inside_a_step_frees_the_cache(tiny_llama, monkeypatch):
    proposer = make_proposer("pld")

    def broken(*args, **kwargs):
        raise RuntimeError("verification failed")

    monkeypatch.setattr(tiny_llama, "verify", broken)
    with pytest.raises(RuntimeError, match="verification failed"):
        decode(tiny_llama, proposer, tiny_llama.prepare("Hello there"), max_new_tokens=8)
    assert not tiny_llama.holds_cache


def test_prompt_plus_max_new_tokens_beyond_the_context_is_refused(tiny_llama):
    inputs = tiny_llama.prepare("Hello")
    too_many = tiny_llama.max_context - inputs.input_ids.shape[1] + 1
    with pytest.raises(InputError, match="context"):
        Decoding(tiny_llama, make_proposer("ar"), inputs, max_new_tokens=too_many)
