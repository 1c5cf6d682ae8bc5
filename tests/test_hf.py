"""`model.generate(custom_generate=recap.hf.custom_generate(...))` on the user's own model."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import TextIteratorStreamer

from recap.errors import InputError
from recap.hf import custom_generate
from recap.images import synthetic_image
from recap.verifier.sampling import SamplingError
from tests.conftest import TINY_MODELS, fixed_cost_profile, load_target
from tests.helpers import assert_drafted


def _kwargs(target, prompt="Tell me about the sea."):
    inputs = target.prepare(prompt, synthetic_image(1, 40, 32) if target.accepts_images else None)
    return {"input_ids": inputs.input_ids, **inputs.extra}


# custom_generate wraps the model in its own adapter, whose automatic cost profile is the
# suite's fixed one (tests/conftest.py): tree sizes, hence tau, do not depend on this machine.
@pytest.mark.lossless
@pytest.mark.parametrize("model", TINY_MODELS)
def test_greedy_equals_plain_generate_and_drafts_are_accepted(model):
    target = load_target(model)
    kwargs = _kwargs(target)
    reference = target.model.generate(**kwargs, max_new_tokens=16, do_sample=False)
    recap_generate = custom_generate("recap", cost_profile=fixed_cost_profile())
    for _ in range(2):  # the second call drafts from the first (one stream)
        out = target.model.generate(**kwargs, max_new_tokens=16, do_sample=False, custom_generate=recap_generate)
        assert torch.equal(out, reference)
    assert_drafted(recap_generate, min_accepted=8)
    assert recap_generate.last.tau > 1.5


@pytest.mark.lossless
@pytest.mark.parametrize("model", TINY_MODELS)
def test_sampling_follows_torch_s_seed_whatever_the_method(model):
    target = load_target(model)
    kwargs = _kwargs(target)
    outputs = []
    # one stream: its second call drafts from the first
    recap_generate = custom_generate("recap", cost_profile=fixed_cost_profile())
    for method in ("ar", recap_generate, recap_generate):
        torch.manual_seed(11)
        outputs.append(target.model.generate(**kwargs, max_new_tokens=16, do_sample=True, temperature=0.8, top_k=8,
                                             top_p=0.95,
                                             custom_generate=custom_generate(method, cost_profile=fixed_cost_profile())
                                             if isinstance(method, str) else method))
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[1], outputs[2])
    assert_drafted(recap_generate, min_accepted=8)
    torch.manual_seed(12)
    other = target.model.generate(**kwargs, max_new_tokens=16, do_sample=True, temperature=0.8, top_k=8,
                                  custom_generate=custom_generate("recap", cost_profile=fixed_cost_profile()))
    assert not torch.equal(other, outputs[0])


@pytest.mark.lossless
def test_a_streamer_receives_the_text_as_it_is_committed():
    target = load_target("tiny-llama")
    kwargs = _kwargs(target)
    reference = target.model.generate(**kwargs, max_new_tokens=20, do_sample=False)
    expected = target.tokenizer.decode(reference[0, kwargs["input_ids"].shape[1]:], skip_special_tokens=True)
    streamer = TextIteratorStreamer(target.tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=120)
    result = {}
    recap_generate = custom_generate("recap", cost_profile=fixed_cost_profile())
    target.model.generate(**kwargs, max_new_tokens=20, do_sample=False, custom_generate=recap_generate)
    # the streamed call drafts from the first: steps of several tokens reach the streamer

    def run():
        try:
            result["out"] = target.model.generate(**kwargs, max_new_tokens=20, do_sample=False, streamer=streamer,
                                                  custom_generate=recap_generate)
        except Exception as error:  # surfaced below, and the streamer is closed so the test never hangs
            result["error"] = error
            streamer.end()

    thread = threading.Thread(target=run)
    thread.start()
    pieces = list(streamer)
    thread.join()
    assert "error" not in result, result.get("error")
    assert "".join(pieces) == expected and len(pieces) >= 1
    assert torch.equal(result["out"], reference)
    assert_drafted(recap_generate, min_accepted=8)
    out = target.model.generate(**kwargs, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                                custom_generate=custom_generate("recap", cost_profile=fixed_cost_profile()))
    assert torch.equal(out.sequences, reference[:, : kwargs["input_ids"].shape[1] + 5])


def test_what_cannot_be_done_exactly_is_refused():
    target = load_target("tiny-llama")
    kwargs = _kwargs(target)
    recap_generate = custom_generate("recap", cost_profile=fixed_cost_profile())
    with pytest.raises(InputError, match="batch"):
        target.model.generate(input_ids=kwargs["input_ids"].repeat(2, 1), max_new_tokens=4,
                              custom_generate=recap_generate)
    with pytest.raises(InputError, match="beam"):
        target.model.generate(**kwargs, max_new_tokens=4, num_beams=2, custom_generate=recap_generate)
    with pytest.raises(SamplingError, match="RepetitionPenalty"):
        target.model.generate(**kwargs, max_new_tokens=4, repetition_penalty=1.3, custom_generate=recap_generate)
