"""GGUF files of random-weight models, written with ``gguf``'s own writer.

Why: loading a GGUF without its float copy (`stored.model_from_file`) has to be shown on
models of every supported family and on one far larger than this machine would want to
de-quantise, and no such file can be had offline. These are real files in llama.cpp's
layout (Llama q/k rows permuted as llama.cpp's converter stores them, norms and biases in
float32, SmolLM2's tokenizer or a byte-level one), so transformers' own GGUF loader reads
them too: the comparison the tests make.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from recap.verifier.kernels import quantized
from recap.verifier.kernels.stored import ROLES

Q4_K_M = {"embed": "Q6_K", "head": "Q6_K", "v": "Q6_K", "down": "Q6_K"}
"""Roles a Q4_K_M file stores in Q6_K (llama.cpp's choice, in its simplest form); the rest Q4_K."""


@dataclass(frozen=True)
class Shape:
    """A decoder's sizes, in llama.cpp's metadata terms."""

    architecture: str = "llama"
    """``llama`` or ``qwen2`` (q/k/v biases)."""
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    tied: bool = True
    """Whether the head is the token embedding (no ``output`` tensor)."""
    formats: dict[str, str] = field(default_factory=lambda: dict(Q4_K_M))
    """Block format by role (`stored.ROLES`, ``embed``, ``head``); Q4_K where absent."""

    def format(self, role: str) -> str:
        return self.formats.get(role, "Q4_K")


def parameter_count(shape: Shape, vocab: int) -> int:
    """Weights the model holds (biases and norms included)."""
    head_dim = shape.hidden // shape.heads
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    layer = shape.hidden * (2 * q + 2 * kv) + 3 * shape.hidden * shape.intermediate + 2 * shape.hidden
    if shape.architecture == "qwen2":
        layer += q + 2 * kv
    return shape.layers * layer + vocab * shape.hidden * (1 if shape.tied else 2) + shape.hidden


TOKENIZERS = ("smollm2", "bytes")
"""``smollm2``: SmolLM2's 49152-token BPE (a real vocabulary; every reader of the file then
parses it, seconds each); ``bytes``: a byte-level BPE of 257 tokens and one merge, plus three
special tokens (what tests load many times)."""


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = iter(range(256, 512))
    return [chr(byte if byte in kept else next(moved)) for byte in range(256)]


def write(path: str | os.PathLike, shape: Shape, *, seed: int = 0, tokenizer: str = "smollm2") -> Path:
    """Write a random-weight model of ``shape`` with ``tokenizer`` (`TOKENIZERS`) to ``path``;
    returns the path."""
    import gguf

    from recap.models import smollm2_gguf

    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {tokenizer!r}")
    path = Path(path)
    source = gguf.GGUFReader(smollm2_gguf()) if tokenizer == "smollm2" else None
    tokens = _byte_tokens() + ["Ġt", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = len(source.fields["tokenizer.ggml.tokens"].data) if source is not None else len(tokens)
    rng = np.random.default_rng(seed)
    arch = shape.architecture
    head_dim = shape.hidden // shape.heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"random {arch} {parameter_count(shape, vocab) / 1e9:.2f}B")
    writer.add_block_count(shape.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if source is not None:
        for key, value in source.fields.items():
            if key.startswith("tokenizer."):
                types = value.types
                writer.add_key_value(key, value.contents(), types[0], sub_type=types[-1] if len(types) > 1 else None)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([1] * 257 + [3] * 3)
        writer.add_token_merges(["Ġ t"])
        writer.add_bos_token_id(257)
        writer.add_eos_token_id(259)

    def blocks(name: str, role: str, rows: int, columns: int) -> None:
        kind = shape.format(role)
        stored = quantized.random_blocks(rng, rows, columns, kind)
        writer.add_tensor(f"{name}.weight", np.ascontiguousarray(stored).view(np.uint8).reshape(rows, -1),
                          raw_dtype=gguf.GGMLQuantizationType[kind])

    def floats(name: str, width: int, centre: float) -> None:
        writer.add_tensor(name, (centre + 0.1 * rng.standard_normal(width)).astype(np.float32))

    names = gguf.TENSOR_NAMES
    blocks(names[gguf.MODEL_TENSOR.TOKEN_EMBD], "embed", vocab, shape.hidden)
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    sizes = {"q": (q, shape.hidden), "k": (kv, shape.hidden), "v": (kv, shape.hidden), "o": (shape.hidden, q),
             "gate": (shape.intermediate, shape.hidden), "up": (shape.intermediate, shape.hidden),
             "down": (shape.hidden, shape.intermediate)}
    for layer in range(shape.layers):
        floats(names[gguf.MODEL_TENSOR.ATTN_NORM].format(bid=layer) + ".weight", shape.hidden, 1.0)
        floats(names[gguf.MODEL_TENSOR.FFN_NORM].format(bid=layer) + ".weight", shape.hidden, 1.0)
        for role, (rows, columns) in sizes.items():
            name = names[gguf.MODEL_TENSOR[ROLES[role]]].format(bid=layer)
            blocks(name, role, rows, columns)
            if arch == "qwen2" and role in ("q", "k", "v"):
                floats(f"{name}.bias", rows, 0.0)
    floats(names[gguf.MODEL_TENSOR.OUTPUT_NORM] + ".weight", shape.hidden, 1.0)
    if not shape.tied:
        blocks(names[gguf.MODEL_TENSOR.OUTPUT], "head", vocab, shape.hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return path
