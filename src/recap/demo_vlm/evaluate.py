"""How well the demo VLM sees, measured on held-out seeds: accuracy by attribute and how much
its outputs depend on the image.

Scoring reads the generated text with the same vocabulary the templates use (colour, shape,
position and number words), so a right answer in a different wording still counts.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

import torch

from recap.demo_vlm.scenes import (
    BACKGROUNDS,
    COLOURS,
    HELD_OUT_START,
    NUMBERS,
    POSITIONS,
    SHAPES,
    Example,
    make_example,
    states_attribute,
)

_COLOUR = "|".join(COLOURS)
_SHAPE = "|".join(SHAPES)
_POSITION = "|".join(POSITIONS)


def held_out(n: int, offset: int = 0) -> list[Example]:
    """``n`` held-out examples (seeds never used in training)."""
    return [make_example(HELD_OUT_START + offset + i) for i in range(n)]


def score(example: Example, text: str) -> dict[str, bool]:
    """Attribute -> whether ``text`` states the example's value for it."""
    text = text.lower()
    facts = example.facts
    if example.task == "caption" and example.scene.kind == "shapes":
        background = re.search(rf"\b({'|'.join(BACKGROUNDS)}) background", text)
        count = re.search(rf"\b({'|'.join(NUMBERS)}) shapes?\b", text)
        first = re.search(rf"\b({_COLOUR}) ({_SHAPE})\b(?: in the ({_POSITION}))?", text)
        return {
            "background": bool(background) and background.group(1) == facts["background"],
            "count": bool(count) and count.group(1) == facts["count"],
            "colour": bool(first) and first.group(1) == facts["colour"],
            "shape": bool(first) and first.group(2) == facts["shape"],
            "position": bool(first) and first.group(3) == facts["position"],
        }
    if example.task == "caption":  # charts: the values, in order
        values = re.findall(r"\b\d+\b", text.split(":", 1)[-1] if ":" in text else text)
        return {"chart values": " ".join(values) == facts["chart values"]}
    (attribute, value), = facts.items()
    patterns = {"count": rf"\b({'|'.join(NUMBERS)})\b", "background": rf"\b({'|'.join(BACKGROUNDS)})\b",
                "colour": rf"\b({_COLOUR})\b", "shape": rf"\b({_SHAPE})\b", "position": rf"\b({_POSITION})\b",
                "chart values": r"\b(\d+)\b"}
    if example.scene.kind == "line chart" and example.task == "chart values" and "point is" in text:
        text = text.split("point is", 1)[1]
    found = re.search(patterns[attribute], text)
    return {attribute: bool(found) and found.group(1) == value}


def accuracy(scores: Iterable[dict[str, bool]]) -> dict[str, tuple[int, int]]:
    """Attribute -> (correct, total)."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for row in scores:
        for attribute, ok in row.items():
            totals[attribute][0] += ok
            totals[attribute][1] += 1
    return {k: (v[0], v[1]) for k, v in sorted(totals.items())}


@torch.inference_mode()
def answer_loss(target, example: Example, image) -> float:
    """Mean next-token loss of the example's answer given its question and ``image``."""
    model, processor = target.model, target.processor
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": example.question}]}],
        add_generation_prompt=True, tokenize=False)
    encoded = processor(text=[prompt + example.answer + "<|im_end|>"], images=[image], return_tensors="pt")
    prompt_len = processor(text=[prompt], images=[image], return_tensors="pt")["input_ids"].shape[1]
    logits = model(**encoded).logits[0, prompt_len - 1 : -1].float()
    labels = encoded["input_ids"][0, prompt_len:]
    return float(torch.nn.functional.cross_entropy(logits, labels))


def swapped(examples: list[Example], shift: int = 1) -> list[Example]:
    """For each example, another example whose image it gets (a cyclic shift)."""
    return [examples[(i + shift) % len(examples)] for i in range(len(examples))]


def first_content_token(tokens: list[int], tokenizer) -> int | None:
    """The first generated token that states something about the image (`states_attribute`);
    template words like "The" do not count."""
    for token in tokens:
        if states_attribute(tokenizer.decode([token])):
            return token
    return None
