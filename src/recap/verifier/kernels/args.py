"""A decoder family is a config, not a class: `DecoderArgs` covers Llama (SmolLM2, the
demo VLM's and LLaVA / LLaVA-NeXT's language models), Qwen2 (Qwen2-VL / Qwen2.5-VL's), whose
decode steps differ only in q/k/v biases, RoPE parameters and a tied head, and Gemma 3
(Gemma-3-270M, the Gemma 3 VLMs' language model), whose layer adds norms on the attention
and MLP outputs and on queries and keys, a (1 + weight) RMSNorm, a GeLU (tanh) MLP, a scaled
embedding, and sliding-window layers with their own RoPE base.

`unsupported(model)` says why a model cannot take the fast path (None when it can); the
target then keeps the stock transformers path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FAST_TEXT_MODELS = ("llama", "qwen2", "qwen2_vl_text", "qwen2_5_vl_text", "gemma3_text")
"""Text-config model types whose decoder layer is norm -> q/k/v -> (q/k norm) -> RoPE ->
attention -> o -> (norm) -> residual -> norm -> gated MLP -> (norm) -> residual, with RMSNorm
(the bracketed norms: Gemma 3's, `DecoderArgs.sandwich_norms` / ``qk_norms``)."""
GEMMA_TYPES = ("gemma3_text",)
"""Text models with Gemma's layer (`DecoderArgs` fields after ``max_positions``)."""
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
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
    activation: str = "silu"
    """The gated MLP's: ``silu`` or ``gelu_pytorch_tanh`` (Gemma)."""
    norm_offset: float = 0.0
    """RMSNorm multiplies by (offset + weight): 1 for Gemma, whose norm weights are stored
    around 0."""
    sandwich_norms: bool = False
    """Whether the attention and MLP outputs are normed before their residual add (Gemma)."""
    qk_norms: bool = False
    """Whether queries and keys are RMS-normed per head before RoPE (Gemma 3)."""
    windows: tuple[int, ...] = ()
    """Each layer's sliding attention window (0: the layer sees every position); () for a
    model without sliding layers."""
    rope_kinds: tuple[str, ...] = ()
    """Each layer's key into the rotary module (Gemma 3: ``sliding_attention`` layers turn
    with their own RoPE base); () for one rotary table."""

    @classmethod
    def from_hf(cls, config: Any) -> DecoderArgs:
        """From a Hugging Face text config (``model.config.get_text_config(decoder=True)``)."""
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        layers = int(config.num_hidden_layers)
        gemma = getattr(config, "model_type", "") in GEMMA_TYPES
        layer_types = tuple(getattr(config, "layer_types", None) or ())
        window = int(getattr(config, "sliding_window", None) or 0)
        windows = tuple(window if kind == "sliding_attention" else 0 for kind in layer_types) \
            if window and "sliding_attention" in layer_types else ()
        return cls(hidden=int(config.hidden_size), heads=heads,
                   kv_heads=int(getattr(config, "num_key_value_heads", None) or heads), head_dim=int(head_dim),
                   intermediate=int(config.intermediate_size), layers=layers,
                   vocab=int(config.vocab_size), eps=float(config.rms_norm_eps),
                   max_positions=int(getattr(config, "max_position_embeddings", 0) or 1 << 15),
                   activation=activation_of(config), norm_offset=1.0 if gemma else 0.0, sandwich_norms=gemma,
                   qk_norms=gemma, windows=windows, rope_kinds=layer_types if gemma else ())


def activation_of(config: Any) -> str:
    """The MLP activation's name in a text config (Gemma names it ``hidden_activation``)."""
    return str(getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "silu")


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
    if activation_of(config) not in ACTIVATIONS:
        return f"activation {activation_of(config)!r}"
    if getattr(config, "use_sliding_window", False) and "sliding_attention" not in (getattr(config, "layer_types",
                                                                                             None) or []):
        return "sliding-window attention without per-layer types"
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None) is not None:
            return f"{name} (Gemma 2's logit soft-capping)"
    rope = getattr(config, "rope_parameters", None) or {}
    per_kind = [value for value in rope.values() if isinstance(value, dict)] or [rope]  # Gemma 3: per layer type
    for parameters in per_kind:
        if parameters.get("rope_type", "default") not in ROPE_TYPES:
            return f"RoPE type {parameters.get('rope_type')!r}"
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
