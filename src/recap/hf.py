"""RECAP behind transformers' own ``model.generate(custom_generate=...)``.

    from recap.hf import custom_generate
    recap_generate = custom_generate(method="recap")          # one drafting stream
    out = model.generate(**inputs, custom_generate=recap_generate, max_new_tokens=64,
                         do_sample=True, temperature=0.7, streamer=streamer)

`generate` prepares the inputs (VLM pixel values, image grids, M-RoPE included) and hands
them to the callable, which runs RECAP's loop on the model the user already loaded. It
honours the generation config's greedy or sampling settings (temperature, top-k, top-p; the
seed comes from torch's global generator, so ``torch.manual_seed`` makes a run repeatable),
the token limit, EOS, ``max_time`` (as transformers' ``MaxTimeCriteria``: it stops after
the step that ran past it, so the output is a prefix of the full answer) and ``streamer``,
and returns what ``generate`` returns. It refuses, with a clear error, what it cannot do
exactly: batches, beam search, and logits processors that depend on the sequence
(repetition penalty and the like), which would need each tree node's own path.

A cost-aware method (``recap``) sizes its trees with the model's verify-cost profile. Unless
``cost_profile`` is given, the first call measures it on this machine (~15 s) and caches it
under ``$RECAP_CACHE/profiles`` (default ``~/.cache/recap``), with a warning saying so.

The callable holds a wrapped model only as long as the caller does (weakly between calls),
so dropping a model frees it even while the callable lives on.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from recap.core import CostProfile
from recap.decoding import Decoding
from recap.errors import InputError
from recap.proposers import Proposer, make_proposer
from recap.verifier import ModelInputs, TargetModel, wrap
from recap.verifier.sampling import Sampling, SamplingError

WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
STOPS = (MaxLengthCriteria, EosTokenCriteria, MaxTimeCriteria)
DROPPED = ("cache", "past_key_values", "use_cache", "logits_to_keep", "cache_position", "position_ids")
"""generate()'s loop state: RECAP keeps its own cache and positions."""


class RecapGenerate:
    """The callable handed to ``model.generate(custom_generate=...)``; one drafting stream."""

    def __init__(self, method: str | Proposer = "recap", *, kernels: str = "auto",
                 cost_profile: str | os.PathLike | CostProfile | None = None, **options):
        self.proposer = make_proposer(method, **options) if isinstance(method, str) else method
        self.kernels = kernels
        """Decode-step path (`TargetModel.use_kernels`): ``stock`` reproduces ``generate``
        token for token; ``fast`` (auto on supported CPU models) agrees with it up to near-ties."""
        self.cost_profile = cost_profile
        """The verify-cost profile (`TargetModel.use_cost_profile`): ``flat``, a file from
        ``recap calibrate`` or a `CostProfile`; None or ``auto``: cached, or measured once."""
        self._targets: weakref.WeakKeyDictionary[torch.nn.Module, TargetModel] = weakref.WeakKeyDictionary()
        """Each model's wrapper, detached from its model between calls (`_attached`), so the
        entry (and the wrapper's views of the weights) goes when the caller drops the model."""
        self.last = None
        """The `GenerationResult` of the latest call (tau, iterations, timings)."""

    def __call__(self, model, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList,
                 stopping_criteria: StoppingCriteriaList, generation_config, synced_gpus: bool = False,
                 streamer: Any | None = None, **model_kwargs):
        if (generation_config.num_beams or 1) > 1 or (generation_config.num_return_sequences or 1) > 1:
            raise InputError("RECAP does not do beam search or several return sequences (num_beams and "
                             "num_return_sequences must be 1)")
        if input_ids.shape[0] != 1:
            raise InputError(f"RECAP decodes one sequence at a time; got a batch of {input_ids.shape[0]}")
        if any(getattr(generation_config, name, False) for name in ("output_scores", "output_logits",
                                                                     "output_attentions", "output_hidden_states")):
            raise InputError("RECAP does not return scores, logits, attentions or hidden states")
        unsupported = [type(p).__name__ for p in logits_processor if not isinstance(p, WARPERS)]
        if unsupported:
            raise SamplingError(f"RECAP cannot apply {', '.join(unsupported)} exactly (a processor that depends on "
                                "the sequence would need each draft node's own path); remove it from the "
                                "generation config (e.g. repetition_penalty=None)")
        stops = [type(c).__name__ for c in stopping_criteria if not isinstance(c, STOPS)]
        if stops:
            raise InputError(f"RECAP does not support the stopping criteria {', '.join(stops)}")
        timers = [c for c in stopping_criteria if isinstance(c, MaxTimeCriteria)]
        if streamer is None:
            streamer = _generate_streamer()
        with self._attached(model) as target:
            return self._generate(target, input_ids, generation_config, streamer, timers, model_kwargs)

    def _generate(self, target: TargetModel, input_ids: torch.LongTensor, generation_config, streamer: Any | None,
                  timers: list[MaxTimeCriteria], model_kwargs: dict[str, Any]):
        prompt_len = input_ids.shape[1]
        max_new_tokens = int(generation_config.max_length) - prompt_len
        if max_new_tokens < 1:
            raise InputError(f"max_length {generation_config.max_length} leaves no room after the "
                             f"{prompt_len}-token prompt")
        sampling = None
        if generation_config.do_sample:
            seed = int(torch.randint(0, 2**62, (1,)).item())  # torch.manual_seed(...) makes the run repeatable
            sampling = Sampling(float(generation_config.temperature or 1.0), generation_config.top_k or None,
                                generation_config.top_p if generation_config.top_p is not None else None, seed)
        extra = {k: v for k, v in model_kwargs.items() if k not in DROPPED and v is not None}
        positions = model_kwargs.get("position_ids")
        if positions is not None and positions.dim() == 3 and positions.shape[0] == 4:
            positions = positions[1:]  # generate's (text, t, h, w) rows: the M-RoPE ones
        inputs = ModelInputs(input_ids=input_ids, extra=extra, positions=positions if positions is not None
                             and positions.dim() == 3 else None,
                             has_image=any(k.startswith(("pixel", "mm_encoder")) for k in extra))
        eos = generation_config.eos_token_id
        eos = [] if eos is None else [int(e) for e in (eos.tolist() if torch.is_tensor(eos) else
                                                     (eos if isinstance(eos, (list, tuple)) else [eos]))]
        self._announce_measurement(target)
        decoding = Decoding(target, self.proposer, inputs, max_new_tokens=max_new_tokens, eos_token_ids=eos,
                            sampling=sampling)
        steps = iter(decoding)
        try:
            for step in steps:
                if streamer is not None:
                    streamer.put(torch.tensor(step.tokens, dtype=input_ids.dtype))
                # max_time as generate's own loop applies it: checked after every committed step
                if any(bool(timer(input_ids, None).any()) for timer in timers):
                    break
        finally:
            steps.close()
        if streamer is not None:
            streamer.end()
        self.last = decoding.result
        new = torch.tensor([decoding.result.tokens], dtype=input_ids.dtype, device=input_ids.device)
        sequences = torch.cat([input_ids, new], dim=1)
        if generation_config.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences

    @contextlib.contextmanager
    def _attached(self, model: torch.nn.Module) -> Iterator[TargetModel]:
        """The model's wrapper (made at its first call), holding the model only during the call:
        the wrapper keeps no other reference to the top-level module, so between calls nothing
        here keeps the caller's model alive and the weak entry goes with it."""
        target = self._targets.get(model)
        if target is None:
            target = wrap(model, None, kernels=self.kernels)
            if self.cost_profile is not None:
                target.use_cost_profile(self.cost_profile)
            self._targets[model] = target
        target.model = model
        try:
            yield target
        finally:
            target.model = None

    def _announce_measurement(self, target: TargetModel) -> None:
        """Warn before the first cost-aware call measures the verify cost (~15 s) and writes
        its cache file: what happens, where, and how to avoid it."""
        if self.cost_profile not in (None, "auto") or target.cost_profile is not None \
                or not self.proposer.wants_cost:
            return
        from recap.verifier.profile import profile_key, profile_path

        path = profile_path(profile_key(target))
        if not path.exists():
            warnings.warn(f"recap: measuring the verify cost of {target.name} on this machine once (~15 s) and "
                          f"caching it in {path.parent} (the folder is $RECAP_CACHE/profiles, default "
                          "~/.cache/recap/profiles); pass custom_generate(..., cost_profile='flat' or a file from "
                          "`recap calibrate`) to skip it, or set RECAP_CACHE to cache elsewhere", stacklevel=4)


def _generate_streamer():
    """The ``streamer`` given to ``generate()``. transformers 5.x hands a callable
    ``custom_generate`` only the keyword arguments its own loop does not know, so the
    streamer (which generate has already fed the prompt) is read from generate's frame, the
    caller of this callable; the tests check it still arrives."""
    frame = inspect.currentframe()
    try:
        caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
        if caller is not None and caller.f_code.co_name == "generate":
            return caller.f_locals.get("streamer")
        return None
    finally:
        del frame


def custom_generate(method: str | Proposer = "recap", *, kernels: str = "auto",
                    cost_profile: str | os.PathLike | CostProfile | None = None, **options) -> RecapGenerate:
    """A callable for ``model.generate(custom_generate=...)`` drafting with ``method`` (a
    name, with proposer ``options``, or a proposer object). Keep it across calls: it is one
    stream, and it learns from each request. ``cost_profile``: ``flat``, a profile file
    (``recap calibrate``) or a `CostProfile`; by default the cached one, measured (~15 s)
    and cached under ``$RECAP_CACHE`` at the first cost-aware call."""
    return RecapGenerate(method, kernels=kernels, cost_profile=cost_profile, **options)
