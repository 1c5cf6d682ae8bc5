"""Loading: built-in names, local folders, already loaded objects; deterministic tiny builds."""

import pytest
import torch

import recap
from recap import models

from .conftest import load_target


def test_local_folder_and_loaded_objects_give_the_same_target(tiny_llama):
    folder = models.model_cache_dir() / f"tiny-llama-v{models.BUILD_VERSION}"
    by_path = recap.load(str(folder))
    hf_model, tokenizer = models.load_pretrained("tiny-llama")
    by_objects = recap.load((hf_model, tokenizer))
    outputs = [recap.generate(t, "Hello there", max_new_tokens=8).tokens for t in (tiny_llama, by_path, by_objects)]
    assert outputs[0] == outputs[1] == outputs[2]
    assert type(by_objects).__name__ == "TargetModel"


def test_vlm_adapters_are_chosen_by_model_type(tiny_qwen):
    assert tiny_qwen.family == "qwen-vl" and tiny_qwen.accepts_images
    assert recap.load("tiny-llava-next").family == "llava"
    assert recap.load("tiny-llama").family == "causal-lm"


def test_tiny_builds_are_deterministic(tmp_path, monkeypatch):
    """Rebuilding a tiny model from its seed in a fresh cache gives identical weights."""
    original = models.model_cache_dir() / f"tiny-llama-v{models.BUILD_VERSION}"
    fresh = tmp_path / "cache"
    fresh.mkdir()
    # Reuse the converted SmolLM2 tokenizer instead of converting the GGUF file again.
    (fresh / f"smollm2-135m-v{models.BUILD_VERSION}").symlink_to(
        models.model_cache_dir() / f"smollm2-135m-v{models.BUILD_VERSION}")
    monkeypatch.setenv("RECAP_MODEL_CACHE", str(fresh))
    assert models.model_cache_dir() == fresh
    rebuilt, _ = models.load_pretrained("tiny-llama")
    assert (fresh / original.name / "config.json").exists()  # really rebuilt, not found elsewhere
    monkeypatch.undo()
    first, _ = models._load_folder(original, torch.float32)
    for (name, a), (_, b) in zip(first.state_dict().items(), rebuilt.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-llava-next"])
def test_image_processors_take_images_of_any_size(name):
    from recap.images import synthetic_image

    target = load_target(name)
    for width, height in [(1, 1), (13, 700), (900, 40)]:
        inputs = target.prepare("What is it?", synthetic_image(0, width, height))
        placeholders = [t in target.excluded_tokens for t in inputs.prompt_ids]
        assert inputs.has_image and sum(placeholders) >= 1
        rows, _ = target.prefill(inputs)
        assert rows.topk_ids.shape == (inputs.input_ids.shape[1], target.top_k)
        assert not rows.eligible[placeholders].any()
        target.release()
