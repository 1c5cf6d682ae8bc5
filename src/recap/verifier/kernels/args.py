"""A decoder family is a config, not a class: `DecoderArgs` covers Llama (SmolLM2, the
demo VLM's and LLaVA / LLaVA-NeXT's language models) and Qwen2 (Qwen2-VL / Qwen2.5-VL's),
whose decode steps differ only in q/k/v biases, RoPE parameters and a tied head.

`unsupported(model)` says why a model cannot take the fast path (None when it can); the
target then keeps the stock transformers path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FAST_TEXT_MODELS = ("llama", "qwen2", "qwen2_vl_text", "qwen2_5_vl_text")
"""Text-config model types whose decoder layer is norm -> q/k/v -> RoPE -> attention -> o ->
residual -> norm -> SiLU-gated MLP -> residual, with RMSNorm."""
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE variants whose frequencies do not depend on the sequence length: their cos/sin
tables, taken once from the model's own rotary module, hold for every step."""
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class DecoderArgs:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    eps: float
    max_positions: int

    @classmethod
    def from_hf(cls, config: Any) -> DecoderArgs:
        """From a Hugging Face text config (``model.config.get_text_config(decoder=True)``)."""
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(hidden=int(config.hidden_size), heads=heads,
                   kv_heads=int(getattr(config, "num_key_value_heads", None) or heads), head_dim=int(head_dim),
                   intermediate=int(config.intermediate_size), layers=int(config.num_hidden_layers),
                   vocab=int(config.vocab_size), eps=float(config.rms_norm_eps),
                   max_positions=int(getattr(config, "max_position_embeddings", 0) or 1 << 15))


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (embed_tokens, layers, norm, rotary_emb) of a causal LM or a VLM."""
    inner = getattr(model, "model", model)
    return getattr(inner, "language_model", inner)


def unsupported(model: torch.nn.Module) -> str | None:
    """Why the fast path cannot run ``model`` (None: it can)."""
    config = model.config.get_text_config(decoder=True)
    model_type = getattr(config, "model_type", "")
    if model_type not in FAST_TEXT_MODELS:
        return f"text model type {model_type!r} (fast steps cover {', '.join(FAST_TEXT_MODELS)})"
    if model.device.type != "cpu":
        return f"device {model.device} (the fast steps are CPU kernels)"
    if model.dtype not in DTYPES:
        return f"dtype {model.dtype}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None)
                                                                              or []):
        return "sliding-window attention"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        return f"RoPE type {rope.get('rope_type')!r}"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    decoder = language_model(model)
    if not all(hasattr(decoder, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"decoder {type(decoder).__name__} has no embed_tokens/layers/norm/rotary_emb"
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        return "no plain linear output head"
    from recap.verifier.kernels.stored import unmade

    for parameter in model.parameters():  # a placeholder stands for blocks the kernels read from the file
        if parameter.device.type != "cpu" or not (parameter.is_contiguous() or unmade(parameter)):
            return "weights not contiguous on the CPU (the fast path reads them in place)"
    return None
