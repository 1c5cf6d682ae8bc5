"""Seeded synthetic scenes for the demo VLM: coloured shapes, bar charts and line charts.

Every example is a pure function of its seed: the scene (what is drawn), the image drawn
from it, and one question with its answer, worded from the scene description by templates.
Training uses seeds below `HELD_OUT_START`; evaluation uses seeds from it upwards, so held-out
images and wordings were never seen in training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

IMAGE_SIZE = 64
HELD_OUT_START = 1_000_000
"""First held-out seed; training must stay below it."""

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 225),
    "yellow": (240, 210, 40), "purple": (140, 60, 185), "orange": (245, 140, 30),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (245, 245, 245), "black": (20, 20, 20), "gray": (128, 128, 128), "cyan": (60, 215, 225),
}
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
"""The 2 x 2 grid cells, in reading order (each 32 x 32 pixels)."""
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
CHART_MAX = 9
ATTRIBUTE_WORDS = frozenset((*COLOURS, *BACKGROUNDS, *SHAPES, *NUMBERS, "top", "bottom", "left", "right"))


def states_attribute(piece: str) -> bool:
    """Whether a token's text states an attribute of the image (a digit, or the start of a
    colour, shape, number or position word) rather than template wording."""
    piece = piece.strip().lower()
    return piece.isdigit() or (len(piece) >= 2 and any(word.startswith(piece) for word in ATTRIBUTE_WORDS))


@dataclass(frozen=True)
class Shape:
    colour: str
    shape: str
    position: str


@dataclass(frozen=True)
class Scene:
    """What an image shows. ``kind`` is ``shapes``, ``bar chart`` or ``line chart``."""

    kind: str
    background: str = "white"
    objects: tuple[Shape, ...] = ()
    """Shapes in reading order (shapes scenes)."""
    bars: tuple[tuple[str, int], ...] = ()
    """(colour, value) left to right (bar charts)."""
    line_colour: str = ""
    points: tuple[int, ...] = ()
    """Values left to right (line charts)."""


@dataclass(frozen=True)
class Example:
    seed: int
    scene: Scene
    task: str
    """``caption`` or the attribute the question asks about (count, colour, shape, ...)."""
    question: str
    answer: str
    facts: dict[str, str] = field(default_factory=dict)
    """Attribute -> the value the answer states (for scoring held-out generations)."""

    def image(self) -> Image.Image:
        return draw_scene(self.scene, self.seed)


# ----------------------------------------------------------------------------- scenes
def random_scene(rng: np.random.Generator) -> Scene:
    kind = rng.choice(["shapes", "shapes", "bar chart", "line chart"])
    if kind == "shapes":
        count = int(rng.integers(1, 5))
        cells = sorted(rng.choice(len(POSITIONS), size=count, replace=False).tolist())
        objects = tuple(Shape(str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES)), POSITIONS[c]) for c in cells)
        return Scene("shapes", background=str(rng.choice(list(BACKGROUNDS))), objects=objects)
    if kind == "bar chart":
        count = int(rng.integers(2, 5))
        colours = rng.choice(list(COLOURS), size=count, replace=False).tolist()
        values = rng.integers(1, CHART_MAX + 1, size=count).tolist()
        return Scene("bar chart", bars=tuple((str(c), int(v)) for c, v in zip(colours, values, strict=True)))
    count = int(rng.integers(3, 6))
    return Scene("line chart", line_colour=str(rng.choice(list(COLOURS))),
                 points=tuple(int(v) for v in rng.integers(1, CHART_MAX + 1, size=count)))


def draw_scene(scene: Scene, seed: int) -> Image.Image:
    """The image of ``scene``; ``seed`` only jitters sizes and offsets, never content."""
    rng = np.random.default_rng([seed, 1])
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUNDS[scene.background])
    draw = ImageDraw.Draw(image)
    if scene.kind == "shapes":
        for obj in scene.objects:
            _draw_shape(draw, obj, rng)
    elif scene.kind == "bar chart":
        _draw_axes(draw)
        slot = (IMAGE_SIZE - 8) // len(scene.bars)
        for i, (colour, value) in enumerate(scene.bars):
            x0 = 8 + i * slot + slot // 5
            draw.rectangle([x0, _chart_y(value), x0 + slot * 3 // 5, IMAGE_SIZE - 8], fill=COLOURS[colour])
    else:
        _draw_axes(draw)
        step = (IMAGE_SIZE - 16) / (len(scene.points) - 1)
        xy = [(int(10 + i * step), _chart_y(v)) for i, v in enumerate(scene.points)]
        draw.line(xy, fill=COLOURS[scene.line_colour], width=2)
        for x, y in xy:
            draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=COLOURS[scene.line_colour])
    return image


def _chart_y(value: int) -> int:
    """Top of a bar / a point of height ``value``: 5 pixels per unit above the x axis."""
    return IMAGE_SIZE - 8 - 5 * value


def _draw_axes(draw: ImageDraw.ImageDraw) -> None:
    draw.line([(6, 4), (6, IMAGE_SIZE - 7), (IMAGE_SIZE - 3, IMAGE_SIZE - 7)], fill=(0, 0, 0), width=1)


def _draw_shape(draw: ImageDraw.ImageDraw, obj: Shape, rng: np.random.Generator) -> None:
    cell = POSITIONS.index(obj.position)
    size = int(rng.integers(16, 25))
    x0 = (cell % 2) * 32 + int(rng.integers(2, 32 - size - 1))
    y0 = (cell // 2) * 32 + int(rng.integers(2, 32 - size - 1))
    box = [x0, y0, x0 + size, y0 + size]
    fill = COLOURS[obj.colour]
    if obj.shape == "circle":
        draw.ellipse(box, fill=fill)
    elif obj.shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x0 + size / 2, y0), (x0, y0 + size), (x0 + size, y0 + size)], fill=fill)


# ----------------------------------------------------------------------------- wording
def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _plural(n: int, word: str) -> str:
    return f"{NUMBERS[n]} {word}" + ("" if n == 1 else "s")


def caption(scene: Scene, rng: np.random.Generator) -> str:
    """A templated caption that names every attribute of the scene."""
    if scene.kind == "shapes":
        things = [f"{_a(o.colour)} {o.shape} in the {o.position}" for o in scene.objects]
        n, bg = len(scene.objects), scene.background
        templates = [
            f"There {'is' if n == 1 else 'are'} {_plural(n, 'shape')} on {_a(bg)} background: {_join(things)}.",
            f"{_a(bg).capitalize()} background with {_plural(n, 'shape')}: {_join(things)}.",
            f"This image shows {_plural(n, 'shape')} on {_a(bg)} background: {_join(things)}.",
        ]
    elif scene.kind == "bar chart":
        bars = [f"{colour} {value}" for colour, value in scene.bars]
        n = len(scene.bars)
        templates = [
            f"A bar chart with {_plural(n, 'bar')}. From left to right: {_join(bars)}.",
            f"This is a bar chart of {_plural(n, 'bar')}: {_join(bars)}.",
        ]
    else:
        values = [str(v) for v in scene.points]
        n = len(scene.points)
        templates = [
            f"{_a(scene.line_colour).capitalize()} line chart with {_plural(n, 'point')}: {_join(values)}.",
            f"This is {_a(scene.line_colour)} line chart. Its {_plural(n, 'point')} are {_join(values)}.",
        ]
    return str(rng.choice(templates))


CAPTION_QUESTIONS = ("Describe the image.", "What does this image show?", "Write a short caption for this image.",
                     "Describe this picture in one sentence.")


def make_example(seed: int) -> Example:
    """Example number ``seed``: a scene and one question about it (a third are captions)."""
    rng = np.random.default_rng(seed)
    scene = random_scene(rng)
    if rng.random() < 1 / 3:
        return Example(seed, scene, "caption", str(rng.choice(CAPTION_QUESTIONS)), caption(scene, rng),
                       _caption_facts(scene))
    if scene.kind == "shapes":
        task, question, answer, facts = shape_question(scene, rng)
    elif scene.kind == "bar chart":
        task, question, answer, facts = bar_question(scene, rng)
    else:
        task, question, answer, facts = line_question(scene, rng)
    return Example(seed, scene, task, question, answer, facts)


def _caption_facts(scene: Scene) -> dict[str, str]:
    if scene.kind == "shapes":
        first = scene.objects[0]
        return {"background": scene.background, "count": NUMBERS[len(scene.objects)], "colour": first.colour,
                "shape": first.shape, "position": first.position}
    if scene.kind == "bar chart":
        return {"chart values": " ".join(str(v) for _, v in scene.bars)}
    return {"chart values": " ".join(str(v) for v in scene.points)}


def shape_question(scene: Scene, rng: np.random.Generator) -> tuple[str, str, str, dict[str, str]]:
    obj = scene.objects[int(rng.integers(len(scene.objects)))]
    n = len(scene.objects)
    task = str(rng.choice(["count", "background", "colour", "shape", "position"]))
    if task == "count":
        return task, "How many shapes are there?", f"There {'is' if n == 1 else 'are'} {_plural(n, 'shape')}.", \
            {"count": NUMBERS[n]}
    if task == "background":
        return task, "What colour is the background?", f"The background is {scene.background}.", \
            {"background": scene.background}
    if task == "colour":
        return task, f"What colour is the shape in the {obj.position}?", f"It is {obj.colour}.", \
            {"colour": obj.colour}
    if task == "shape":
        answer = f"{_a(obj.colour).capitalize()} {obj.shape}."
        return task, f"What shape is in the {obj.position}?", answer, {"shape": obj.shape}
    return task, f"Where is the {obj.colour} {obj.shape}?", f"In the {obj.position}.", {"position": obj.position}


def bar_question(scene: Scene, rng: np.random.Generator) -> tuple[str, str, str, dict[str, str]]:
    colour, value = scene.bars[int(rng.integers(len(scene.bars)))]
    if rng.random() < 0.7:
        return "chart values", f"What is the value of the {colour} bar?", f"The {colour} bar is {value}.", \
            {"chart values": str(value)}
    top = max(v for _, v in scene.bars)
    tallest = [c for c, v in scene.bars if v == top]
    verb = "bar is" if len(tallest) == 1 else "bars are"
    return "chart values", "Which bar is the tallest?", f"The {_join(tallest)} {verb} the tallest, at {top}.", \
        {"chart values": str(top)}


def line_question(scene: Scene, rng: np.random.Generator) -> tuple[str, str, str, dict[str, str]]:
    ordinals = ("first", "second", "third", "fourth", "fifth")
    i = int(rng.integers(len(scene.points)))
    if rng.random() < 0.7:
        return "chart values", f"What is the value of the {ordinals[i]} point?", \
            f"The {ordinals[i]} point is {scene.points[i]}.", {"chart values": str(scene.points[i])}
    top = max(scene.points)
    return "chart values", "What is the highest value in the chart?", f"The highest value is {top}.", \
        {"chart values": str(top)}
