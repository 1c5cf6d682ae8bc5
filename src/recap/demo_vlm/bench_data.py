"""An MMSpec-format benchmark of the demo VLM's held-out scenes, for ``recap bench``.

``write_scene_benchmark(out)`` writes ``out/mmspec.jsonl`` and ``out/images/scene-<seed>.png``
(64 x 64, the size the model sees). The same arguments always give byte-identical files.
There are four topics, with ``per_topic`` items each, in this order:

- ``captioning``: one caption question (`CAPTION_QUESTIONS`); the scene kinds take turns:
  shapes, bar chart, line chart. One unit an item.
- ``shapes``: one attribute question about a shapes scene (count, background, colour, shape
  or position). One unit an item.
- ``charts``: one value question about a chart; bar and line charts take turns. One unit an item.
- ``multi-turn``: a caption question, then follow-up questions about the same image, worded
  by the same templates `make_example` uses for its scene kind: two follow-ups for the 1st,
  3rd, ... item, one for the 2nd, 4th, ...; the scene kinds take turns as in ``captioning``.
  Three or two units an item.

So ``per_topic`` items a topic give ``5 * per_topic + ceil(per_topic / 2)`` units
(11 for the default 2). Every item is one seed's scene, each seed used once; the question of
the single-turn items and the first turn of multi-turn items is that seed's own
`make_example` question. Seeds are taken in order from ``start`` (default
``HELD_OUT_START + 1000``): held out from training, and clear of the scenes ``recap demo``
shows (offsets 0..6) and those ``benchmarks/demo_vlm_eval.py`` and the training log's check
use (offsets from 0 up, 512 at most by default). Each row also carries ``seed`` and
``references`` (the templated answer to every turn), which the benchmark does not read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recap.demo_vlm.scenes import (
    HELD_OUT_START,
    Example,
    Scene,
    bar_question,
    line_question,
    make_example,
    shape_question,
)
from recap.errors import InputError

TOPICS = ("captioning", "shapes", "charts", "multi-turn")
DEFAULT_START = HELD_OUT_START + 1000
_CAPTION_KINDS = ("shapes", "bar chart", "line chart")
_CHART_KINDS = ("bar chart", "line chart")
_SEARCH_LIMIT = 1_000_000
"""Seeds scanned at most (a third are captions, half are shapes: items come quickly)."""


@dataclass(frozen=True)
class _Item:
    topic: str
    example: Example
    turns: tuple[str, ...]
    references: tuple[str, ...]

    @property
    def image_name(self) -> str:
        return f"scene-{self.example.seed}.png"

    def row(self) -> dict:
        return {"id": f"{self.topic}-{self.example.seed}", "image": self.image_name, "turns": list(self.turns),
                "category": self.example.scene.kind, "topic": self.topic, "seed": self.example.seed,
                "references": list(self.references)}


def units_per_topic(per_topic: int) -> dict[str, int]:
    """Generation units (turns) each topic holds for ``per_topic`` items."""
    follow_ups = sum(2 if i % 2 == 0 else 1 for i in range(per_topic))
    return {"captioning": per_topic, "shapes": per_topic, "charts": per_topic, "multi-turn": per_topic + follow_ups}


def follow_up_questions(example: Example, count: int) -> list[tuple[str, str]]:
    """``count`` distinct (question, answer) pairs about ``example``'s scene, worded by the
    scene module's templates, none repeating the example's own question; seeded by the seed."""
    ask = {"shapes": shape_question, "bar chart": bar_question, "line chart": line_question}[example.scene.kind]
    rng = np.random.default_rng([example.seed, 2])
    seen = {example.question}
    pairs: list[tuple[str, str]] = []
    for _ in range(200):  # every scene kind offers at least three distinct questions
        _task, question, answer, _facts = ask(example.scene, rng)
        if question not in seen:
            seen.add(question)
            pairs.append((question, answer))
            if len(pairs) == count:
                return pairs
    raise RuntimeError(f"seed {example.seed}: found {len(pairs)} of {count} distinct follow-up questions")


def _wants(topic: str, index: int, example: Example) -> bool:
    """Whether ``example`` can be item number ``index`` of ``topic``."""
    scene: Scene = example.scene
    caption = example.task == "caption"
    if topic in ("captioning", "multi-turn"):
        return caption and scene.kind == _CAPTION_KINDS[index % len(_CAPTION_KINDS)]
    if topic == "shapes":
        return not caption and scene.kind == "shapes"
    return not caption and scene.kind == _CHART_KINDS[index % len(_CHART_KINDS)]


def scene_items(per_topic: int = 2, start: int = DEFAULT_START) -> list[_Item]:
    """The benchmark's items, topic by topic (seeds scanned upwards from ``start``)."""
    picked: dict[str, list[Example]] = {topic: [] for topic in TOPICS}
    seed = start
    while any(len(examples) < per_topic for examples in picked.values()):
        if seed - start >= _SEARCH_LIMIT:
            raise RuntimeError(f"no {per_topic} items per topic in seeds {start}..{seed - 1}")
        example = make_example(seed)
        for topic in TOPICS:  # a seed serves one topic at most: every image is different
            if len(picked[topic]) < per_topic and _wants(topic, len(picked[topic]), example):
                picked[topic].append(example)
                break
        seed += 1
    items = []
    for topic in TOPICS:
        for index, example in enumerate(picked[topic]):
            turns, references = [example.question], [example.answer]
            if topic == "multi-turn":
                for question, answer in follow_up_questions(example, 2 if index % 2 == 0 else 1):
                    turns.append(question)
                    references.append(answer)
            items.append(_Item(topic, example, tuple(turns), tuple(references)))
    return items


def _shared_folder() -> Path:
    from recap.bench.data import default_data_dir

    return default_data_dir().parents[1]


def write_scene_benchmark(out: Path, per_topic: int = 2, start: int = DEFAULT_START) -> Path:
    """Write the held-out scene benchmark into folder ``out`` (created if needed; files of
    the same names are replaced) and return it. Bad arguments are an `InputError`."""
    if isinstance(per_topic, bool) or not isinstance(per_topic, int) or per_topic < 1:
        raise InputError(f"--per-topic must be a whole number of at least 1, got {per_topic!r}")
    if start < HELD_OUT_START:
        raise InputError(f"start seed {start} is a training seed; held-out seeds start at {HELD_OUT_START}")
    out = Path(out).expanduser()
    shared = _shared_folder().resolve()
    if out.resolve() == shared or shared in out.resolve().parents:
        raise InputError(f"{out} is inside {shared}, which is read-only here; pick another folder")
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} exists and is not a folder")
    items = scene_items(per_topic, start)
    try:
        (out / "images").mkdir(parents=True, exist_ok=True)
        for item in items:
            item.example.image().save(out / "images" / item.image_name, format="PNG")
        lines = [json.dumps(item.row(), ensure_ascii=False) for item in items]
        (out / "mmspec.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    except OSError as error:
        raise InputError(f"cannot write {out}: {error.strerror or error}") from None
    return out
