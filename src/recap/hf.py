"""RECAP behind transformers' own ``model.generate(custom_generate=...)``.

    from recap.hf import custom_generate
    recap_generate = custom_generate(method="recap")          # one drafting stream
    out = model.generate(**inputs, custom_generate=recap_generate, max_new_tokens=64,
                         do_sample=True, temperature=0.7, streamer=streamer)

`generate` prepares the inputs (VLM pixel values, image grids, M-RoPE included) and hands
them to the callable, which runs RECAP's loop on the model the user already loaded. It
honours the generation config's greedy or sampling settings (temperature, top-k, top-p; the
seed comes from torch's global generator, so ``torch.manual_seed`` makes a run repeatable),
the token limit, EOS and ``streamer``, and returns what ``generate`` returns. It refuses,
with a clear error, what it cannot do exactly: batches, beam search, and logits processors
that depend on the sequence (repetition penalty and the like), which would need each tree
node's own path.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from recap.decoding import Decoding
from recap.errors import InputError
from recap.proposers import Proposer, make_proposer
from recap.target import ModelInputs, TargetModel, wrap
from recap.target.sampling import Sampling, SamplingError

WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
STOPS = (MaxLengthCriteria, EosTokenCriteria, MaxTimeCriteria)
DROPPED = ("cache", "past_key_values", "use_cache", "logits_to_keep", "cache_position", "position_ids")
"""generate()'s loop state: RECAP keeps its own cache and positions."""


class RecapGenerate:
    """The callable handed to ``model.generate(custom_generate=...)``; one drafting stream."""

    def __init__(self, method: str | Proposer = "recap", *, kernels: str = "auto", **options):
        self.proposer = make_proposer(method, **options) if isinstance(method, str) else method
        self.kernels = kernels
        """Decode-step path (`TargetModel.use_kernels`): ``stock`` reproduces ``generate``
        token for token; ``fast`` (auto on supported CPU models) agrees with it up to near-ties."""
        self._targets: dict[int, TargetModel] = {}
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
        if streamer is None:
            streamer = _generate_streamer()
        target = self._target(model)
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
        decoding = Decoding(target, self.proposer, inputs, max_new_tokens=max_new_tokens, eos_token_ids=eos,
                            sampling=sampling)
        for step in decoding:
            if streamer is not None:
                streamer.put(torch.tensor(step.tokens, dtype=input_ids.dtype))
        if streamer is not None:
            streamer.end()
        self.last = decoding.result
        new = torch.tensor([decoding.result.tokens], dtype=input_ids.dtype, device=input_ids.device)
        sequences = torch.cat([input_ids, new], dim=1)
        if generation_config.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences

    def _target(self, model) -> TargetModel:
        key = id(model)
        if key not in self._targets:
            self._targets[key] = wrap(model, None, kernels=self.kernels)
        return self._targets[key]


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


def custom_generate(method: str | Proposer = "recap", *, kernels: str = "auto", **options) -> RecapGenerate:
    """A callable for ``model.generate(custom_generate=...)`` drafting with ``method`` (a
    name, with proposer ``options``, or a proposer object). Keep it across calls: it is one
    stream, and it learns from each request."""
    return RecapGenerate(method, kernels=kernels, **options)
