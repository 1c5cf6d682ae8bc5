"""A GGUF model built without its float copy (`recap.verifier.kernels.stored.model_from_file`,
``recap.load(path, float_copy=False)``, chosen by ``float_copy=None`` where the floats would
not fit): the kernels read the file alone, and every logit equals, bit for bit, that of the
model transformers' own loader builds from the same file. Random-weight files of both
supported families (`random_gguf`: every block format, Llama's permuted q/k, Qwen2's
biases, a tied and an untied head); a wrong reading of the file (Llama's q/k rows left
permuted) is the negative control."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import recap
from recap import models
from recap.errors import InputError
from recap.verifier.kernels import FastDecoder, quantized, random_gguf, stored
from recap.verifier.kernels.stored import StoredWeights, model_from_file, unmade
from tests.helpers import assert_drafted, step_logits

# One worker, Gemma-3-270M's (tests/test_gemma3.py): the module's files load once, and the stored kernels
# of the formats both read compile once, not in both workers at the same time.
pytestmark = pytest.mark.xdist_group("gguf_files")

SHAPES = {
    "llama": random_gguf.Shape(formats={"embed": "Q8_0", "q": "Q4_0", "k": "Q4_1", "v": "Q5_0", "o": "Q5_1",
                                        "gate": "Q4_K", "up": "Q5_K", "down": "Q6_K"}),
    "qwen2": random_gguf.Shape(architecture="qwen2", heads=2, kv_heads=1, tied=False, layers=3,
                               formats={"embed": "Q4_K", "head": "Q6_K", "q": "Q8_0", "down": "Q6_K"}),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    return {name: random_gguf.write(folder / f"random-{name}.gguf", shape, seed=7, tokenizer="bytes")
            for name, shape in SHAPES.items()}


@pytest.fixture(scope="module")
def with_floats(files) -> dict[str, recap.TargetModel]:
    """Each file as transformers' loader builds it (the float copy made and checked)."""
    return {name: recap.load(path, float_copy=True) for name, path in files.items()}


def _weights_held(model: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters() if not unmade(parameter))


@pytest.mark.parametrize("name", list(SHAPES))
def test_a_model_built_from_the_file_alone_gives_the_float_models_logits(name, files, with_floats, monkeypatch):
    """With too little memory for the float copy, ``float_copy=None`` builds the model from
    the file alone: it holds no float copy of any block weight, its logits equal those of
    the model transformers builds (on the same blocks and on its floats) bit for bit, recap
    on it gives plain greedy decoding's tokens on the floats, and the stock path, once asked
    for, rebuilds the floats exactly (``model.generate`` agrees)."""
    monkeypatch.setattr(models, "available_memory", lambda: 0)
    alone, floats = recap.load(files[name]), with_floats[name]
    assert alone.float_copy is False and floats.float_copy is True
    assert alone.weights == floats.weights == "stored"
    assert alone.parameter_count == floats.parameter_count
    assert _weights_held(alone.model) < 10_000  # norms and biases
    on_blocks = step_logits(floats.decoder)
    assert floats.use_weights("float") == "float"  # from here on, its own float weights
    for a, b, c in zip(step_logits(alone.decoder), on_blocks, step_logits(floats.decoder), strict=True):
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
        np.testing.assert_array_equal(a.view(np.uint32), c.view(np.uint32))
    prompt = "Count from one to twenty, then back down to one."
    drafted = recap.generate(alone, prompt, method="recap", max_new_tokens=40)
    assert drafted.tokens == recap.generate(floats, prompt, method="ar", max_new_tokens=40).tokens
    assert_drafted(drafted)
    alone.use_kernels("stock")
    assert _weights_held(alone.model) == alone.parameter_count
    floats.use_kernels("stock")
    try:
        assert recap.generate(alone, prompt, method="ar", max_new_tokens=12).tokens == \
            recap.generate(floats, prompt, method="ar", max_new_tokens=12).tokens
    finally:
        floats.use_kernels("fast")


def test_every_block_tensor_is_read_from_the_file_and_listed_as_trusted(files):
    """`StoredWeights.blocks` on a model without floats: every block tensor handed to the
    kernels, none compared (there is nothing to compare with), each named under ``trusted``."""
    model = model_from_file(files["qwen2"])
    blocks = StoredWeights.open(files["qwen2"])
    decoder = FastDecoder(model, stored=blocks, warm_rows=(1,))
    assert decoder.weights == "stored" and not blocks.checked
    assert set(blocks.trusted) == {name for name, (kind, _) in blocks.tensors.items() if kind in quantized.FORMATS}
    assert all(unmade(parameter) for parameter, _ in decoder.stored_pairs)


def test_a_wrong_reading_of_the_file_is_caught(files, with_floats, monkeypatch):
    """Negative control: with Llama's q/k rows left in the file's (llama.cpp's) order, the
    model built from the file alone decodes, and its logits differ from the float model's."""
    monkeypatch.setattr(stored, "_llama_rows", lambda rows, heads: np.arange(rows))
    wrong = recap.load(files["llama"], float_copy=False)
    right = step_logits(with_floats["llama"].decoder)
    assert any(not np.array_equal(a, b) for a, b in zip(step_logits(wrong.decoder), right, strict=True))


def test_what_a_model_without_floats_refuses(files):
    path = files["llama"]
    with pytest.raises(InputError, match="float_copy=True for the stock path"):
        recap.load(path, float_copy=False, kernels="stock")
    for options in ({"weights": "float"}, {"dtype": "bfloat16"}):
        with pytest.raises(InputError, match="neither weights='float' nor another dtype"):
            recap.load(path, float_copy=False, **options)
    with pytest.raises(InputError, match="tiny-llama is not one"):
        recap.load("tiny-llama", float_copy=False)
    with pytest.raises(InputError, match="CPU kernels only"):
        recap.load(path, float_copy=False, device="meta")


@pytest.mark.slow
def test_smollm2_built_from_its_file_alone_decodes_as_the_builtin():
    """SmolLM2's own Q4_1 / Q8_0 file without the float copy: the built-in's greedy tokens,
    with only the norms held as floats."""
    from recap.models import smollm2_gguf

    alone = recap.load(smollm2_gguf(), float_copy=False)
    assert alone.float_copy is False and alone.weights == "stored"
    assert _weights_held(alone.model) < 100_000
    prompt = "Name three colours and a fruit of each."
    builtin = recap.load("smollm2-135m")
    assert recap.generate(alone, prompt, method="ar", max_new_tokens=24).tokens == \
        recap.generate(builtin, prompt, method="ar", max_new_tokens=24).tokens


@pytest.mark.parametrize("which", ["smollm2", "llama"])
def test_float_bytes_counts_every_tensor_as_float32(which, files):
    """What ``float_copy=None`` decides on: four bytes a weight, read from the header (SmolLM2's
    Q4_1 / Q8_0 file through transformers' header reader, the random Llama's Q5_0 / Q5_1 blocks
    through ``gguf``'s)."""
    import gguf

    from recap.models import smollm2_gguf
    from recap.verifier.kernels.stored import float_bytes

    path = smollm2_gguf() if which == "smollm2" else files["llama"]
    expected = 4 * sum(int(tensor.n_elements) for tensor in gguf.GGUFReader(path).tensors)
    assert float_bytes(path) == expected > 0
