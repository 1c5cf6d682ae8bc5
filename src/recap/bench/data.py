"""Benchmark inputs: MMSpec-format data sets, validated up front, split into generation units.

Format (one JSON object per line of ``mmspec.jsonl``): ``{id, image, turns[], category,
topic}``, images under ``images/<image>`` next to the file. Every problem (a bad row, an
unknown topic, a missing image) is an `InputError` naming the file and line, raised before
any model time is spent.

A *unit* is one turn of one item: one generation and one request. Later turns of a
multi-turn item are asked with the earlier questions and the model's earlier answers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from recap.errors import InputError

MMSPEC_SYSTEM_PROMPT = ("A chat between a curious human and an artificial intelligence assistant. The assistant "
                        "gives helpful, detailed, and polite answers to the human's questions.")
"""MMSpec's own system prompt (``../shared/DESIGN.md`` section 7), used for every request."""

DATA_FILE = "mmspec.jsonl"


@dataclass(frozen=True)
class BenchItem:
    """One input of the data set: an image and one or more user turns."""

    id: str
    topic: str
    turns: tuple[str, ...]
    image: Path | None
    category: str = ""


@dataclass(frozen=True)
class Unit:
    """One generation: turn ``turn`` of ``item`` (a request of its own)."""

    item: BenchItem
    turn: int

    @property
    def key(self) -> str:
        """Stable identity in results.jsonl (resume skips finished keys)."""
        return f"{self.item.id}#{self.turn}"

    @property
    def topic(self) -> str:
        return self.item.topic

    @property
    def question(self) -> str:
        return self.item.turns[self.turn]


def default_data_dir() -> Path:
    """``../shared/data/mmspec`` beside the repository this package runs from."""
    return Path(__file__).resolve().parents[4] / "shared" / "data" / "mmspec"


def mmspec_path(spec: str | None) -> Path:
    """The MMSpec jsonl file a spec names: ``mmspec`` (the default folder), ``mmspec=PATH`` or
    ``PATH`` (a folder holding mmspec.jsonl, or the jsonl file itself). ``--data`` also takes
    the repeats set built from it: `recap.bench.sources.resolve_data`."""
    spec = (spec or "mmspec").strip()
    if spec == "mmspec":
        folder = default_data_dir()
        if not (folder / DATA_FILE).is_file():
            raise InputError(f"MMSpec data not found at {folder}; pass --data mmspec=PATH (a folder with "
                             f"{DATA_FILE} and images/, or the jsonl file)")
        return folder / DATA_FILE
    if spec.startswith("mmspec="):
        spec = spec[len("mmspec="):]
    if not spec:
        raise InputError("--data mmspec= needs a path after '='")
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / DATA_FILE
    if not path.is_file():
        raise InputError(f"data not found: {path} (expected a folder with {DATA_FILE} or a .jsonl file)")
    return path.resolve()


def _field(row: dict, name: str, kind: type, where: str):
    value = row.get(name)
    if not isinstance(value, kind) or (isinstance(value, str) and not value.strip()):
        raise InputError(f"{where}: field {name!r} must be a non-empty {kind.__name__}, got {value!r}")
    return value


def parse_row(row: object, where: str, folder: Path) -> BenchItem:
    """One validated item; ``where`` ("file:line") prefixes every error."""
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(row).__name__}")
    item_id = _field(row, "id", str, where)
    topic = _field(row, "topic", str, where)
    turns = row.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise InputError(f"{where}: field 'turns' must be a non-empty list of non-empty strings, got {turns!r}")
    image = row.get("image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise InputError(f"{where}: field 'image' must be a file name or null, got {image!r}")
    category = row.get("category") or ""
    if not isinstance(category, str):
        raise InputError(f"{where}: field 'category' must be a string, got {category!r}")
    image_path = None
    if image:
        nested = folder / "images" / image
        image_path = nested if nested.exists() or not (folder / image).exists() else folder / image
    return BenchItem(id=item_id, topic=topic, turns=tuple(turns), image=image_path, category=category)


def load_items(path: Path) -> list[BenchItem]:
    """Every item of a jsonl file, in file order; ids must be unique."""
    items: list[BenchItem] = []
    seen: set[str] = set()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"cannot read {path}: {error}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path.name}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise InputError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
        item = parse_row(row, where, path.parent)
        if item.id in seen:
            raise InputError(f"{where}: duplicate id {item.id!r}")
        seen.add(item.id)
        items.append(item)
    if not items:
        raise InputError(f"{path} holds no items")
    return items


def _topic_key(name: str) -> str:
    return " ".join(name.lower().replace("-", " ").replace("_", " ").split())


def select(items: Sequence[BenchItem], topics: Sequence[str] | None = None,
           limit: int | None = None) -> list[BenchItem]:
    """Items of the chosen topics (all by default, in file order; ``general-vqa`` matches
    ``general vqa``), at most ``limit`` per topic, grouped topic by topic."""
    available = list(dict.fromkeys(item.topic for item in items))
    by_key = {_topic_key(t): t for t in available}
    if topics:
        chosen = []
        for name in topics:
            topic = by_key.get(_topic_key(name))
            if topic is None:
                raise InputError(f"unknown topic {name!r}; the data has: {', '.join(available)}")
            if topic not in chosen:
                chosen.append(topic)
    else:
        chosen = available
    picked: list[BenchItem] = []
    for topic in chosen:
        mine = [item for item in items if item.topic == topic]
        picked.extend(mine[:limit] if limit is not None else mine)
    return picked


def check_images(items: Sequence[BenchItem]) -> None:
    """Every selected image exists and opens (header only), so a run cannot stop midway."""
    from PIL import Image, UnidentifiedImageError

    for item in items:
        if item.image is None:
            raise InputError(f"item {item.id} has no image, but the model takes images (every MMSpec item has one)")
        try:
            with Image.open(item.image) as image:
                image.size  # noqa: B018 - reads the header
        except FileNotFoundError:
            raise InputError(f"image of item {item.id} not found: {item.image}") from None
        except (UnidentifiedImageError, OSError) as error:
            raise InputError(f"cannot read the image of item {item.id} ({item.image}): {error}") from None


def units_of(items: Sequence[BenchItem]) -> list[Unit]:
    """Generation units in run order: item by item, turn by turn."""
    return [Unit(item, turn) for item in items for turn in range(len(item.turns))]


def messages_for(unit: Unit, answers: Sequence[str], system_prompt: str | None = MMSPEC_SYSTEM_PROMPT) -> list[dict]:
    """Chat messages of a unit: system prompt, earlier questions with the given answers to
    them (the AR reference's, so every method sees the same input), then this turn's
    question. The image, if any, is placed in the first user turn by ``target.prepare``."""
    if len(answers) < unit.turn:
        raise ValueError(f"unit {unit.key} needs {unit.turn} earlier answers, got {len(answers)}")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for turn in range(unit.turn):
        messages.append({"role": "user", "content": quote_answers(unit.item.turns[turn], answers[:turn])})
        messages.append({"role": "assistant", "content": answers[turn]})
    messages.append({"role": "user", "content": quote_answers(unit.question, answers[: unit.turn])})
    return messages


_ANSWER_REF = re.compile(r"\{answer:(\d+)\}")


def quote_answers(turn: str, answers: Sequence[str]) -> str:
    """``turn`` with each ``{answer:K}`` replaced by the answer to turn K (an earlier one): how
    a user message quotes the model's own text (the ``repeats`` stress set)."""
    def answer(match: re.Match) -> str:
        k = int(match.group(1))
        if k >= len(answers):
            raise InputError(f"a turn quotes {{answer:{k}}}, but only {len(answers)} earlier answer(s) exist")
        return answers[k].strip()

    return _ANSWER_REF.sub(answer, turn) if "{answer:" in turn else turn

