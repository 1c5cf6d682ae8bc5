"""Target models: one adapter per model family behind `TargetModel`, its steps run on a lane
of transformers' forward (`recap.verifier.stock`) or of the project's kernels
(`recap.verifier.fast`).

A new vision-language family is a `_VisionLanguageTarget` subclass in `vision_language.py`,
registered in `FAMILIES` by its ``config.model_type``; other decoder-only ``*ForCausalLM``
models need no adapter. What the decoding loop needs of any target (a model or a stand-in)
is the `Target` protocol (`recap.verifier.protocol`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from recap.errors import InputError
from recap.verifier.base import TargetModel
from recap.verifier.inputs import ModelInputs
from recap.verifier.profile import MeasuringSession
from recap.verifier.protocol import BaseTarget, Target
from recap.verifier.vision_language import GemmaVLTarget, LlavaTarget, QwenVLTarget

FAMILIES: dict[str, type[TargetModel]] = {
    "qwen2_vl": QwenVLTarget,
    "qwen2_5_vl": QwenVLTarget,
    "llava": LlavaTarget,
    "llava_next": LlavaTarget,
    "gemma3": GemmaVLTarget,
}
"""``config.model_type`` -> adapter. Other decoder-only ``*ForCausalLM`` models use `TargetModel`."""


def wrap(model: torch.nn.Module, processor: Any, *, top_k: int = 8, kernels: str = "auto", weights: str = "auto",
         gguf_file: str | os.PathLike | None = None) -> TargetModel:
    """The adapter for an already loaded model and its processor (or tokenizer); ``kernels``
    picks the decode-step path (`TargetModel.use_kernels`), ``weights`` what it reads
    (`TargetModel.weights`; ``gguf_file``: the file the model was de-quantised from)."""
    model_type = getattr(model.config, "model_type", "")
    options = dict(top_k=top_k, kernels=kernels, weights=weights, gguf_file=gguf_file)
    if model_type in FAMILIES:
        return FAMILIES[model_type](model, processor, **options)
    if type(model).__name__.endswith("ForCausalLM") and not getattr(model.config, "is_encoder_decoder", False):
        return TargetModel(model, processor, **options)
    raise InputError(f"unsupported architecture {type(model).__name__} ({model_type or 'no model_type'}); "
                     f"supported: decoder-only *ForCausalLM models and {', '.join(sorted(FAMILIES))}")


__all__ = ["FAMILIES", "BaseTarget", "GemmaVLTarget", "LlavaTarget", "MeasuringSession", "ModelInputs", "QwenVLTarget",
           "Target", "TargetModel", "wrap"]
