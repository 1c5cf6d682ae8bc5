"""GGUF blocks read as stored (`recap.verifier.kernels.quantized`, `quantized_linear`,
`stored`): every format de-quantises in registers to ``gguf``'s float32 weights bit for bit,
so a layer, a step and a model on stored blocks give the float path's logits exactly. Two
deliberately wrong de-quantisations (a scale rounded the wrong way, nibbles in the wrong
order) are caught; the fused multiply-add the kernels use is shown to be exact for every
float16 scale rather than assumed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from llvmlite import ir
from numba import njit

import recap
from recap.errors import InputError
from recap.verifier.kernels import FastDecoder, lanes, pairs, quantized, quantized_linear
from recap.verifier.kernels import linear as kernel_linear
from recap.verifier.kernels.lanes import LANES
from recap.verifier.kernels.linear import KernelDefect, Linear, SameInput
from recap.verifier.kernels.stored import StoredWeights, WeightsMismatch
from tests.conftest import TINY_MODELS, load_target
from tests.helpers import assert_drafted, step_logits

FORMATS = list(quantized.FORMATS)


@njit  # not cached: numba's cache follows this file only, so a cached copy would keep testing
# `quantized.py`'s code generation as it was when it was compiled
def _by_block(stored, out):  # pragma: no cover - compiled
    # every weight through `lanes.load_block`, a whole 32-weight block at a time
    for row in range(stored.shape[0]):
        for k in range(0, out.shape[1], 4 * LANES):
            groups = lanes.load_block(stored, row, k)
            for g in range(4):
                for i in range(LANES):
                    out[row, k + g * LANES + i] = lanes.lane(groups[g], i)


@njit  # not cached, as `_by_block`
def _by_pairs(stored, out):  # pragma: no cover - compiled
    # every weight through `pairs.load_blocks`, rows r and N - 1 - r side by side (N even)
    n = stored.shape[0]
    for first in range(n // 2):
        second = n - 1 - first
        for k in range(0, out.shape[1], 4 * LANES):
            groups = pairs.load_blocks(stored, first, second, k)
            for g in range(4):
                low, high = pairs.low(groups[g]), pairs.high(groups[g])
                for i in range(LANES):
                    out[first, k + g * LANES + i] = lanes.lane(low, i)
                    out[second, k + g * LANES + i] = lanes.lane(high, i)


READERS = {"block": _by_block, "pairs": _by_pairs}
"""The two ways the kernels de-quantise: one weight row a vector (`lanes.load_block`) and two
side by side (`pairs.load_blocks`, the 8-weight-row blocks)."""


def _kernel_weights(stored: np.ndarray, reader: str = "block") -> np.ndarray:
    out = np.full((len(stored), quantized.weights_per_row(stored)), np.nan, np.float32)
    READERS[reader](stored, out)
    return out


def _every_byte(stored: np.ndarray) -> np.ndarray:
    """``stored`` with its quant and packed-scale bytes running through every value 0..255
    (every nibble pair, every 2- and 6-bit field) and, for Q5_0 / Q5_1, every high-bit byte
    pattern."""
    stored = stored.copy()
    for field in stored.dtype.names:
        if field.endswith(("_qs", "_ql", "_qh", "_scales")) and stored.dtype[field].shape:
            shape = stored[field].shape
            values = np.arange(np.prod(shape)) * (7 if field.endswith("_scales") else 1) % 256
            stored[field] = values.astype(np.uint8).view(stored.dtype[field].base).reshape(shape)
        elif field.endswith("_qh"):
            patterns = np.arange(stored.size, dtype=np.uint64) * np.uint64(0x01010101)
            stored[field] = (patterns % np.uint64(1 << 32)).astype(np.uint32).reshape(stored.shape)
    return stored


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("name", FORMATS)
def test_every_format_dequantises_to_the_bits_of_gguf(name, reader):
    rng = np.random.default_rng(len(name))
    stored = quantized.random_blocks(rng, 48, 256 * 2, name)
    for blocks in (stored, _every_byte(stored)):
        expected = quantized.dequantize(blocks)
        assert np.isfinite(expected).all()
        np.testing.assert_array_equal(_kernel_weights(blocks, reader).view(np.uint32), expected.view(np.uint32))
    scales = stored[f"{name.lower()}_d"].view(np.float16)
    assert (np.abs(scales) < np.float16(6.1e-5)).any(), "no subnormal float16 scale was exercised"


def test_k_quant_scaled_quants_are_exact_in_float32():
    """Why Q4_K / Q5_K fuse too: ``(d * scale) * q`` with a 6-bit scale and a 5-bit q is d
    times an integer below 2**11; every float16 significand (11 bits, subnormals included)
    times every such integer has at most 22 significant bits: exact in float32, whatever
    the exponent (float32's range holds float16's times 2**11)."""
    significands = np.arange(2048, dtype=np.float32)  # every float16 significand, as an integer
    integers = np.arange(2048, dtype=np.float32)
    products = significands[:, None] * integers[None, :]
    np.testing.assert_array_equal(products.astype(np.float64),
                                  significands[:, None].astype(np.float64) * integers[None, :].astype(np.float64))


def test_scaled_quants_are_exact_in_float32_for_every_float16_scale():
    """Why the kernels may fuse ``(d * q) + m`` into one multiply-add: for every finite
    float16 d and every quant the formats hold (|q| <= 32), d * q is exact in float32, so
    rounding it before the addition changes nothing."""
    d = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    d = d[np.isfinite(d)].astype(np.float32)
    q = np.arange(-32, 33, dtype=np.float32)
    products = d[:, None] * q[None, :]
    exact = d[:, None].astype(np.float64) * q[None, :].astype(np.float64)
    np.testing.assert_array_equal(products.astype(np.float64), exact)


def _smollm2_file() -> Path:
    from recap.models import smollm2_gguf

    return smollm2_gguf()


def _gemma_file() -> Path:
    from recap.models import gemma3_gguf

    return gemma3_gguf()  # into ~/.cache, once (a test dependency, never committed)


@pytest.mark.parametrize("file, tensor, kind", [
    ("smollm2", "token_embd", "Q8_0"), ("smollm2", "blk.3.ffn_down", "Q4_1"), ("smollm2", "blk.7.attn_q", "Q4_1"),
    ("gemma3", "blk.0.attn_output", "Q4_K"), ("gemma3", "blk.4.ffn_down", "Q6_K"), ("gemma3", "blk.2.attn_q", "Q5_0"),
    ("gemma3", "blk.0.attn_v", "Q8_0"),
])
def test_real_blocks_dequantise_to_the_bits_of_gguf(file, tensor, kind):
    """Real files: SmolLM2's (Q4_1 layers, a Q8_0 embedding that is also the tied head) and
    Gemma 3 270M's Q4_K_M (Q4_K, Q6_K, Q5_0 and Q8_0 tensors)."""
    weights = StoredWeights.open(_smollm2_file() if file == "smollm2" else _gemma_file())
    found, raw = weights.tensors[tensor]
    assert found == kind
    stored = quantized.blocks(raw, kind)[:512]
    for reader in READERS:
        np.testing.assert_array_equal(_kernel_weights(stored, reader).view(np.uint32),
                                      quantized.dequantize(stored).view(np.uint32), err_msg=reader)


def _scale_through_bfloat16(builder, base, offset):
    # a wrong widening: the float16 scale rounded to bfloat16's 8 significant bits
    wide = builder.fpext(builder.bitcast(quantized._at(builder, base, offset, quantized._I16), ir.HalfType()),
                         quantized._FLOAT)
    bits = builder.bitcast(wide, quantized._I32)
    return builder.bitcast(builder.and_(bits, ir.Constant(quantized._I32, 0xFFFF0000)), quantized._FLOAT)


def _high_nibbles_first(builder, blocks, start, group, count):
    # a wrong layout: weights 0-15 read from the bytes' high nibbles
    swapped = builder.xor(group, ir.Constant(group.type, 2))
    return _original_nibbles(builder, blocks, start, swapped, count)


_original_nibbles = quantized._nibbles


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("mistake", ["scale", "nibbles"])
def test_a_wrong_dequantisation_is_caught(mistake, reader, monkeypatch):
    """The comparison above can fail: a kernel compiled with a wrong widening of the scale,
    or with the block's nibbles in the other order, differs from ``gguf`` (the same fresh
    compile without the mistake agrees), one row a vector or two."""
    stored = quantized.random_blocks(np.random.default_rng(3), 16, 64, "Q4_1")
    expected = quantized.dequantize(stored).view(np.uint32)
    for wrong in (False, True):
        if wrong and mistake == "scale":
            monkeypatch.setattr(quantized, "_half", _scale_through_bfloat16)
        elif wrong:
            monkeypatch.setattr(quantized, "_nibbles", _high_nibbles_first)
        out = np.zeros((16, 64), np.float32)
        njit(READERS[reader].py_func)(stored, out)  # a fresh dispatcher: compiled now, with or without the mistake
        assert np.array_equal(out.view(np.uint32), expected) != wrong


@pytest.mark.parametrize("weight_rows", [3, 4])
@pytest.mark.parametrize("name", FORMATS)
def test_a_layer_on_stored_blocks_gives_the_float_layers_bits(name, weight_rows):
    """Every row count's path (1, 2: the few-row blocks; 3, 4: the 8x4 block or panels;
    5-8, 13-16, 21-24 and 29-32: the 4x8 block in registers or panels; 9-12: the 2x12 block or
    panels; 17-20, 25-28, 33: panels), N not a multiple of 4 (the last columns one at a time),
    a bias."""
    rng = np.random.default_rng(weight_rows)
    width = 96 if quantized.FORMATS[name].block == 32 else 256
    stored = quantized.random_blocks(rng, 4 * 9 + 3, width, name)
    bias = rng.standard_normal(len(stored), dtype=np.float32)
    on_blocks = Linear(stored, bias, weight_rows=weight_rows)
    on_floats = Linear(quantized.dequantize(stored), bias, weight_rows=weight_rows)
    assert on_blocks.blocks.name == name and on_floats.blocks is None
    x = rng.standard_normal((36, width), dtype=np.float32)
    for rows in range(1, 34):
        a = np.zeros((36, len(stored)), np.float32)
        b = np.zeros((36, len(stored)), np.float32)
        on_blocks(x, a, rows)
        on_floats(x, b, rows)
        np.testing.assert_array_equal(a[:rows].view(np.uint32), b[:rows].view(np.uint32), err_msg=f"{rows} rows")


def _float64_row(x, w, bias, out, row):
    """Row ``row`` of x @ dequantised(w).T + bias summed in float64, then rounded: another order."""
    wide = x[row].astype(np.float64) @ quantized.dequantize(w).astype(np.float64).T
    out[row, :len(w)] = (wide + bias if len(bias) else wide).astype(np.float32)


@pytest.mark.parametrize("name", ["linear_few_paired", "linear_four", "linear_eights", "linear_twelve", "linear_few"])
def test_a_stored_block_out_of_the_written_order_is_refused(name, monkeypatch):
    """The load-time check of the stored blocks can fail: the paired 8x1 / 8x2 blocks
    (`linear_few_paired`), the 8x4 block (`linear_four`), the 4x8 block in registers
    (`linear_eights`), the 2x12 block (`linear_twelve`) or the 4x1 / 4x2 blocks (`linear_few`,
    the 3-row layout's) with one token row summed in float64 make `stored_blocks_agree` false, and `Linear` refuses the
    weights instead of giving other bits than the float layer."""
    weight_rows = 3 if name == "linear_few" else 4
    check = kernel_linear.stored_blocks_agree.__wrapped__
    assert check(96, "Q4_1", weight_rows)
    real = getattr(quantized_linear, name)
    if name in ("linear_few", "linear_few_paired"):
        def kernel(x, w, bias, out, rows):
            real(x, w, bias, out, rows)
            _float64_row(x, w, bias, out, rows - 1)
    elif name in ("linear_four", "linear_twelve"):
        def kernel(x, w, bias, out):
            real(x, w, bias, out)
            _float64_row(x, w, bias, out, len(x) - 1)
    else:
        def kernel(x, w, bias, out, rows):
            real(x, w, bias, out, rows)
            _float64_row(x, w, bias, out, 13)  # a row of the second 4x8 block
    monkeypatch.setattr(quantized_linear, name, kernel)
    monkeypatch.setattr(kernel_linear, "stored_blocks_agree", check)
    assert not check(96, "Q4_1", weight_rows)
    with pytest.raises(KernelDefect, match="lanes"):
        Linear(quantized.random_blocks(np.random.default_rng(5), 60, 96, "Q4_1"), None, weight_rows=weight_rows)


@pytest.mark.parametrize("name", FORMATS)
def test_layers_called_as_one_give_each_layers_own_bits(name):
    """`SameInput`: q, k, v (and gate, up: two layers) of one format, with and without bias,
    sizes that leave 1-3 columns past the last block of 4 and span several parallel tasks,
    called as one for every row count (one kernel for 1-2 rows) give each layer's own call,
    bit for bit; every column is written (the outputs start as NaN)."""
    rng = np.random.default_rng(len(name))
    width = 96 if quantized.FORMATS[name].block == 32 else 256
    sizes = (4 * 8 * 2 + 5, 4 * 3 + 2, 3)  # three tasks and a tail; one task and a tail; the tail alone
    layers = tuple(Linear(quantized.random_blocks(rng, n, width, name),
                          rng.standard_normal(n, dtype=np.float32) if i != 1 else None) for i, n in enumerate(sizes))
    x = rng.standard_normal((8, width), dtype=np.float32)
    for joined in (SameInput(layers), SameInput(layers[:2])):
        assert joined.joined
        for rows in range(1, 6):
            outs = tuple(np.full((8, layer.out_features), np.nan, np.float32) for layer in joined.layers)
            joined(x, outs, rows)
            for layer, out in zip(joined.layers, outs, strict=True):
                alone = np.full((8, layer.out_features), np.nan, np.float32)
                layer(x, alone, rows)
                np.testing.assert_array_equal(out[:rows].view(np.uint32), alone[:rows].view(np.uint32),
                                              err_msg=f"{rows} rows")
    block = quantized.FORMATS[name].block
    other = next(kind for kind in FORMATS if kind != name and quantized.FORMATS[kind].block == block)
    mixed = Linear(quantized.random_blocks(rng, 8, width, other), None)
    floats = Linear(quantized.dequantize(layers[0].weight), None)
    assert not SameInput((layers[0], mixed)).joined and not SameInput((layers[0], floats)).joined


# --------------------------------------------------------------------------- whole models
def _stored_twin(model: torch.nn.Module, seed: int) -> StoredWeights:
    """Give ``model``'s decoder random GGUF blocks (cycling through every format): each
    linear weight and the embedding become the blocks' de-quantisation, in place; returns
    those blocks as a `StoredWeights` (llama.cpp's names, rows in the model's order)."""
    import gguf

    from recap.verifier.kernels.args import language_model
    from recap.verifier.kernels.stored import ROLES

    rng = np.random.default_rng(seed)
    decoder = language_model(model)
    tensors, formats = {}, iter(FORMATS * 100)

    def give(name: str, weight: torch.Tensor) -> None:
        kind = next(formats)
        while weight.shape[1] % quantized.FORMATS[kind].block:  # K-quants need rows of whole 256-weight blocks
            kind = next(formats)
        stored = quantized.random_blocks(rng, weight.shape[0], weight.shape[1], kind)
        for field in stored.dtype.names:  # scales 40x larger: logits spread apart, as the tiny models' init
            if field.endswith(("_d", "_m")):
                stored[field] = (stored[field].view(np.float16) * np.float16(40)).view(np.uint16)
        with torch.no_grad():
            weight.copy_(torch.from_numpy(quantized.dequantize(stored)))
        tensors[name] = (kind, np.ascontiguousarray(stored).view(np.uint8).reshape(len(stored), -1))

    give(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.TOKEN_EMBD], decoder.embed_tokens.weight)
    for i, layer in enumerate(decoder.layers):
        modules = {"q": layer.self_attn.q_proj, "k": layer.self_attn.k_proj, "v": layer.self_attn.v_proj,
                   "o": layer.self_attn.o_proj, "gate": layer.mlp.gate_proj, "up": layer.mlp.up_proj,
                   "down": layer.mlp.down_proj}
        for role, module in modules.items():
            give(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[ROLES[role]]].format(bid=i), module.weight)
    head = model.get_output_embeddings()
    if head.weight.data_ptr() != decoder.embed_tokens.weight.data_ptr():
        give(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.OUTPUT], head.weight)
    return StoredWeights(Path("<random blocks>"), "synthetic", tensors)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_every_family_on_stored_blocks_gives_the_float_steps_bits(name):
    """A tiny model of each family with GGUF-block weights (every format): a prefill and a
    packed verify read as stored give, bit for bit, the logits of the same model's floats."""
    target = recap.load(name, kernels="stock")
    stored = _stored_twin(target.model, seed=len(name))
    on_blocks = FastDecoder(target.model, stored=stored, warm_rows=(1,))
    on_floats = FastDecoder(target.model, warm_rows=(1,))
    assert on_blocks.weights == "stored" and on_floats.weights == "float"
    assert set(stored.checked) == set(stored.tensors)
    for a, b in zip(step_logits(on_blocks), step_logits(on_floats), strict=True):
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.slow
def test_smollm2_reads_its_gguf_blocks_and_gives_the_float_logits(smollm2):
    """`recap.load` reads SmolLM2's Q4_1 / Q8_0 blocks by default; its logits equal, bit for
    bit, those of the same model on its de-quantised floats, and recap on the blocks gives
    plain greedy decoding's output on the floats, token for token."""
    floats = recap.load("smollm2-135m", weights="float")
    assert smollm2.weights == "stored" and floats.weights == "float"
    for stored_logits, float_logits in zip(step_logits(smollm2.decoder), step_logits(floats.decoder), strict=True):
        np.testing.assert_array_equal(stored_logits.view(np.uint32), float_logits.view(np.uint32))
    prompt = "List the planets of the solar system in order, then list them again in reverse order."
    drafted = recap.generate(smollm2, prompt, method="recap", max_new_tokens=48)
    plain = recap.generate(floats, prompt, method="ar", max_new_tokens=48)
    assert list(drafted.tokens) == list(plain.tokens)
    assert_drafted(drafted)
    # the float copies of what the kernels read as blocks are not kept: the norms alone remain
    smollm2.use_kernels("fast")
    assert sum(parameter.numel() for parameter in smollm2.model.parameters()) < 100_000
    assert floats.parameter_count == smollm2.parameter_count > 100_000_000


def test_a_file_that_is_not_the_models_is_refused():
    """Blocks that do not de-quantise to the model's weight: `WeightsMismatch` with
    ``weights="stored"``, a warning and the float weights with ``auto``."""
    model = recap.load("tiny-llama", kernels="stock").model
    stored = _stored_twin(model, seed=1)
    kind, raw = stored.tensors["blk.1.ffn_up"]
    raw = raw.copy()
    raw[3, 7] ^= 0x10  # one nibble of one block
    stored.tensors["blk.1.ffn_up"] = (kind, raw)
    with pytest.raises(WeightsMismatch, match="blk.1.ffn_up"):
        FastDecoder(model, stored=stored, warm_rows=(1,))


def test_weights_selection_and_errors(tmp_path, monkeypatch):
    with pytest.raises(InputError, match="needs the fast kernels and a model loaded from a GGUF file"):
        recap.load("tiny-llama", weights="stored")
    with pytest.raises(InputError, match="unknown weights"):
        recap.load("tiny-llama", weights="int4")
    assert load_target("tiny-llama").weights == "float"
    (tmp_path / "broken.gguf").write_bytes(b"GGUF not really")
    with pytest.raises(InputError, match="broken.gguf"):
        recap.load(str(tmp_path / "broken.gguf"))


def test_float_copies_are_dropped_and_rebuilt_exactly_when_the_model_runs():
    """`FloatCopies`: the float weights the kernels read as blocks are freed, and the model's
    own forward (transformers' path) first rebuilds them, bit for bit, from the blocks."""
    from recap.verifier.kernels.stored import FloatCopies

    model = recap.load("tiny-llama", kernels="stock").model
    stored = _stored_twin(model, seed=2)
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    ids = torch.arange(5)[None] + 100
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    copies = FloatCopies(model, FastDecoder(model, stored=stored, warm_rows=(1,)).stored_pairs)
    copies.drop()
    kept = {name for name, parameter in model.named_parameters() if parameter.numel()}
    assert kept == {name for name in before if "norm" in name}
    with torch.no_grad():
        again = model(input_ids=ids).logits  # the pre-hook rebuilds the floats first
    assert not copies.dropped
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter.view(-1).view(torch.int32), before[name].view(-1).view(torch.int32)), name
    assert torch.equal(again, logits)


@pytest.mark.slow
def test_the_demo_vlm_reads_its_language_models_blocks():
    """The demo VLM's frozen language model is SmolLM2's: its layers, embedding and head come
    from SmolLM2's file (each checked), the image token's row past the file's vocabulary
    stays float (`GrownLinear`), and a step's logits (the image token's row included) equal
    those on the float weights, bit for bit."""
    from recap.verifier.kernels.linear import GrownLinear

    stored = recap.load("recap-demo-vlm")
    floats = recap.load("recap-demo-vlm", weights="float")
    assert stored.weights == "stored" and floats.weights == "float"
    head = stored.decoder.head
    assert isinstance(head, GrownLinear) and head.blocks.name == "Q8_0" and head.grown.out_features == 1
    assert stored.decoder.layers[0].q.blocks.name == "Q4_1"
    image_token = stored.model.config.image_token_id
    assert image_token >= len(stored.decoder.embed)
    rows = np.zeros((4, stored.decoder.args.hidden), np.float32)
    expected = np.zeros_like(rows)
    tokens = np.array([5, image_token, 100, image_token], np.int64)
    stored.decoder._embed(tokens, rows)
    floats.decoder._embed(tokens, expected)
    np.testing.assert_array_equal(rows.view(np.uint32), expected.view(np.uint32))
    # an image prompt runs the model's own forward up to the language model: nothing rebuilt
    from PIL import Image

    assert stored.fast_runner.float_copies.dropped
    stored.prefill(stored.prepare("Describe the image.", Image.new("RGB", (64, 48), "red")))
    stored.release()
    assert stored.fast_runner.float_copies.dropped
    for a, b in zip(step_logits(stored.decoder), step_logits(floats.decoder), strict=True):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_gguf_sources_are_found(tmp_path):
    """Which GGUF file a model name came from: the built-ins', a ``.gguf`` path, a folder
    holding exactly one (without a config.json: else it is a Hugging Face folder)."""
    from recap.models import gguf_source

    assert gguf_source("smollm2-135m") == gguf_source("recap-demo-vlm") == _smollm2_file()
    assert gguf_source("tiny-llama") is None
    (tmp_path / "model.gguf").symlink_to(_smollm2_file())
    assert gguf_source(str(tmp_path / "model.gguf")) == tmp_path / "model.gguf"
    assert gguf_source(str(tmp_path)) == tmp_path / "model.gguf"
    (tmp_path / "other.gguf").symlink_to(_smollm2_file())
    assert gguf_source(str(tmp_path)) is None  # two files: which one is ambiguous
    (tmp_path / "other.gguf").unlink()
    (tmp_path / "config.json").write_text("{}")
    assert gguf_source(str(tmp_path)) is None


@pytest.mark.slow
def test_a_gguf_path_loads_and_decodes_from_its_blocks():
    """`recap.load("model.gguf")`: transformers builds the float model from the file, the
    kernels read the file's blocks (checked against it), greedy output as the built-in's."""
    target = recap.load(str(_smollm2_file()))
    assert target.weights == "stored" and target.gguf_file == _smollm2_file()
    assert target.float_copy  # a small file: transformers de-quantises it too, and the blocks are checked
    builtin = load_target("smollm2-135m")
    prompt = "Name three colours."
    assert recap.generate(target, prompt, method="ar", max_new_tokens=12).tokens == \
        recap.generate(builtin, prompt, method="ar", max_new_tokens=12).tokens


@pytest.mark.parametrize("file", ["smollm2", "gemma3"])
def test_the_tensor_table_reads_what_gguf_reads(file, tmp_path):
    """`read_tensor_table` (which steps over the metadata: Gemma 3's 262k-token vocabulary
    took ``GGUFReader`` about 10 s) gives every tensor's type and bytes as ``GGUFReader`` does,
    and the architecture; a file that is not GGUF is refused."""
    import gguf

    from recap.verifier.kernels.stored import float_bytes, read_tensor_table

    path = _smollm2_file() if file == "smollm2" else _gemma_file()
    architecture, tensors = read_tensor_table(path)
    reader = gguf.GGUFReader(path)
    assert architecture == str(reader.fields["general.architecture"].contents())
    assert list(tensors) == [tensor.name for tensor in reader.tensors]
    for tensor in reader.tensors:
        kind, raw = tensors[tensor.name]
        assert kind == tensor.tensor_type.name and raw.dtype == np.uint8
        assert raw.tobytes() == np.ascontiguousarray(tensor.data).tobytes()
    assert float_bytes(path) == 4 * sum(int(tensor.n_elements) for tensor in reader.tensors)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUX" + path.read_bytes()[4:4096])
    with pytest.raises(InputError, match="not a readable GGUF"):
        StoredWeights.open(broken)
