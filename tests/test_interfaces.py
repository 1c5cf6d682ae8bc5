"""The declared interfaces: every real target and proposer satisfies `Target` / `Proposer`,
the decoding loop uses what they declare (and nothing it would have to probe for), and the
target's measuring session is what the cost profiler times."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import recap
from recap import decoding
from recap.core import ROWS_WANTED, CostProfile, DraftTree
from recap.decoding import Decoding, decode
from recap.errors import InputError
from recap.overhead import SyntheticTarget
from recap.proposers import PROPOSERS, BaseProposer, PromptLookupProposer, Proposer, make_proposer
from recap.verifier import BaseTarget, MeasuringSession, Target
from recap.verifier.profile import measuring
from recap.verifier.sampling import Sampling
from tests.conftest import TINY_MODELS, load_target

VOCAB = 2048


# ----------------------------------------------------------------------------- conformance
@pytest.mark.parametrize("name", list(PROPOSERS))
def test_every_registered_proposer_satisfies_the_protocol(name):
    proposer = make_proposer(name)
    assert isinstance(proposer, Proposer)
    for flag in ("stream_state", "wants_cost", "wants_image_attention"):
        assert isinstance(getattr(proposer, flag), bool), flag
    assert proposer.rows_wanted in ROWS_WANTED
    assert isinstance(proposer.stage_times(), dict)


def test_only_the_methods_that_ask_declare_it():
    assert make_proposer("recap").wants_cost and not make_proposer("recap-paper").wants_cost
    assert make_proposer("sam-viskip").wants_image_attention and not make_proposer("sam").wants_image_attention
    assert not any(make_proposer(name).wants_image_attention for name in PROPOSERS if name != "sam-viskip")
    rows = {name: make_proposer(name).rows_wanted for name in PROPOSERS}
    seeding = {"recap-paper", "tree-recycling"}  # seed from each eligible prompt token's first row
    answers = {"recap"}  # those first rows inside earlier assistant turns
    testing = {"decoy", "random"}  # test drafters keep the safe default
    assert {name for name, wanted in rows.items() if wanted == "first"} == seeding
    assert {name for name, wanted in rows.items() if wanted == "answers"} == answers
    assert {name for name, wanted in rows.items() if wanted == "all"} == testing
    assert {name for name, wanted in rows.items() if wanted == "none"} == set(PROPOSERS) - seeding - answers - testing
    assert make_proposer("recap", seed_prompt="all").rows_wanted == "first"
    with pytest.raises(InputError, match="seed_prompt"):
        make_proposer("recap", seed_prompt="some")


@pytest.mark.parametrize("name", TINY_MODELS)
def test_every_model_family_satisfies_the_target_protocol(name):
    target = load_target(name)
    assert isinstance(target, Target) and target.can_sample
    assert target.max_context is not None and target.max_context > 0
    inputs = target.prepare("How long is this prompt?")
    assert target.prompt_length(inputs) == inputs.input_ids.shape[1]


def test_the_synthetic_target_satisfies_the_target_protocol():
    target = SyntheticTarget(VOCAB)
    assert isinstance(target, Target)
    assert not target.can_sample and target.max_context is None and target.sliding_window is None
    assert target.verify_cost() is None and not target.capture_image_attention(True)
    assert target.prompt_length([1, 2, 3]) == 3


def test_an_object_missing_a_declared_ability_is_not_a_target():
    class Bare:
        """prefill / verify / commit alone: what the loop used to accept by probing."""

        eos_token_ids: list[int] = []
        vocab_size, past_len = 8, 0

        def prefill(self, inputs, sampler=None): ...

        def verify(self, root, tree, sampler=None, position=0): ...

        def commit(self, accepted): ...

    assert not isinstance(Bare(), Target)
    assert isinstance(type("Defaults", (BaseTarget, Bare), {})(), Target)  # BaseTarget supplies the rest
    assert not isinstance(object(), Proposer)


def test_the_loop_reads_no_ability_it_does_not_declare():
    """`Decoding` calls the declared members; probing (getattr / hasattr) would mean an
    ability the protocols do not state."""
    source = inspect.getsource(decoding.Decoding)
    assert "getattr(" not in source and "hasattr(" not in source


# ----------------------------------------------------------------------------- the loop uses them
class RecordingTarget(SyntheticTarget):
    """The synthetic target with a cost profile and an image-attention capture it records."""

    def __init__(self, *args, **options):
        super().__init__(*args, cost_profile=CostProfile.linear(0.1), **options)
        self.capture_requests: list[bool] = []
        self.rows_requests: list[str] = []
        self.cost_requests = 0

    def keep_prompt_rows(self, rows="all"):
        self.rows_requests.append(rows)
        return "all"

    def capture_image_attention(self, enabled: bool = True) -> bool:
        self.capture_requests.append(enabled)
        return False

    def verify_cost(self) -> CostProfile | None:
        self.cost_requests += 1
        return super().verify_cost()


class AskingDrafter(PromptLookupProposer):
    """PLD that declares every wish and keeps the limits it is given."""

    name = "asking"
    wants_cost = True
    wants_image_attention = True
    rows_wanted = "first"

    def propose(self, history, limits=None):
        self.limits = limits
        return super().propose(history, limits)


def test_declared_wishes_reach_the_target():
    target = RecordingTarget(VOCAB)
    prompt = target.sample_prompt(40)
    asking = AskingDrafter()
    decode(target, asking, prompt, max_new_tokens=6)
    assert target.capture_requests == [True] and target.cost_requests == 1
    assert asking.limits.cost is target.cost_profile
    assert asking.limits.context_len == target.past_len  # the last step's: never committed (the limit was hit)
    plain = PromptLookupProposer()
    decode(target, plain, prompt, max_new_tokens=6)
    assert target.capture_requests == [True, False] and target.cost_requests == 1  # not asked, not measured
    assert target.rows_requests == ["first", "none"]  # PLD never reads the prompt's Top-K rows


def test_declared_limits_are_enforced():
    class Windowed(SyntheticTarget):
        sliding_window = 50

    class Short(SyntheticTarget):
        max_context = 50

    prompt = list(range(1, 41))
    for target, what in ((Windowed(VOCAB), "sliding attention window"), (Short(VOCAB), "context of 50")):
        with pytest.raises(InputError, match=what):
            Decoding(target, make_proposer("ar"), prompt, max_new_tokens=11)
        assert len(decode(target, make_proposer("ar"), prompt, max_new_tokens=10).tokens) == 10


def test_sampling_on_a_greedy_only_target_is_refused_up_front():
    target = SyntheticTarget(VOCAB)
    with pytest.raises(InputError, match="greedily"):
        Decoding(target, make_proposer("ar"), [1, 2, 3], max_new_tokens=4, sampling=Sampling(0.7, seed=1))
    with pytest.raises(InputError, match="greedily"):
        target.prefill([1, 2, 3], object())  # a sampler handed to it anyway is an error, not ignored


def test_base_proposer_defaults_ask_for_nothing():
    base = BaseProposer()
    assert not base.wants_cost and not base.wants_image_attention and not base.stream_state
    assert base.rows_wanted == "all"  # the safe default: a method reading the prompt's Top-K rows gets them
    assert base.stage_times() == {}
    base.set_reference([1, 2, 3])  # accepted and ignored


# ----------------------------------------------------------------------------- measuring session
@pytest.mark.parametrize("kernels", ["stock", "fast"])
def test_a_measuring_session_restores_the_prefix_and_frees_the_cache(kernels):
    shared = load_target("tiny-llama")
    target = recap.wrap(shared.model, shared.processor, kernels=kernels)
    tree = DraftTree([5, 6, 7], [-1, 0, -1])
    with measuring(target, np.arange(10, 22)) as session:
        assert isinstance(session, MeasuringSession) and session.context_len == target.past_len == 12
        session.step(tree)
        assert target.past_len == 13  # the root's entry, as a decode step commits it
        with pytest.raises(RuntimeError, match="restore"):
            session.step(tree)  # a second step without restoring would see another context
        session.restore()
        assert target.past_len == 12
        session.step(DraftTree.empty())
        session.restore()
        session.restore()  # idempotent
        assert target.past_len == 12
    assert not target.holds_cache


def test_a_measuring_session_turns_the_capture_off_and_back_on():
    shared = load_target("tiny-qwen2.5-vl")
    target = recap.wrap(shared.model, shared.processor)
    assert target.capture_image_attention(True)
    with measuring(target, np.arange(10, 20)):
        assert not target.capture.enabled  # the stock attention path is what gets timed
    assert target.capture.enabled
    target.capture_image_attention(False)
    with measuring(target, np.arange(10, 20)):
        pass
    assert target.capture is None or not target.capture.enabled  # off stays off
