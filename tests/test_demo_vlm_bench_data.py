"""The demo VLM's held-out scenes as MMSpec-format benchmark data (no model needed)."""

import json
import shlex
from collections import Counter

import pytest
from PIL import Image

from recap.bench.data import DATA_FILE, check_images, load_items, select, units_of
from recap.cli import main
from recap.demo import DEMO_SCENES
from recap.demo_vlm.bench_data import TOPICS, units_per_topic, write_scene_benchmark
from recap.demo_vlm.scenes import CAPTION_QUESTIONS, HELD_OUT_START, IMAGE_SIZE, make_example
from recap.errors import InputError


def _files(folder):
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file()}


def test_folder_loads_with_the_documented_topics_and_units(tmp_path):
    out = write_scene_benchmark(tmp_path / "scenes")
    assert out == tmp_path / "scenes"
    items = load_items(out / DATA_FILE)
    check_images(items)
    assert [item.topic for item in items] == [topic for topic in TOPICS for _ in range(2)]
    units = Counter(unit.topic for unit in units_of(items))
    assert units == units_per_topic(2) == {"captioning": 2, "shapes": 2, "charts": 2, "multi-turn": 5}
    assert len(units_of(select(items, limit=None))) == 11

    rows = [json.loads(line) for line in (out / DATA_FILE).read_text().splitlines()]
    seeds = [row["seed"] for row in rows]
    assert len(set(seeds)) == len(seeds) and min(seeds) >= HELD_OUT_START + 1000
    assert not set(seeds) & {HELD_OUT_START + offset for offset in (*DEMO_SCENES, *range(512))}
    for item, row in zip(items, rows, strict=True):
        example = make_example(row["seed"])
        with Image.open(item.image) as image:
            assert image.format == "PNG" and image.size == (IMAGE_SIZE, IMAGE_SIZE)
            assert image.convert("RGB").tobytes() == example.image().tobytes()
        assert item.turns[0] == example.question and row["references"][0] == example.answer
        assert item.category == example.scene.kind and len(row["references"]) == len(item.turns)
        if item.topic in ("captioning", "multi-turn"):
            assert example.task == "caption" and item.turns[0] in CAPTION_QUESTIONS
        else:
            assert example.task != "caption" and len(item.turns) == 1
        if item.topic == "shapes":
            assert example.scene.kind == "shapes"
        if item.topic == "charts":
            assert example.scene.kind in ("bar chart", "line chart")
        if item.topic == "multi-turn":
            follow_ups = item.turns[1:]
            assert 1 <= len(follow_ups) <= 2 and len(set(item.turns)) == len(item.turns)
            assert not set(follow_ups) & set(CAPTION_QUESTIONS)
    charts = [item.category for item in items if item.topic == "charts"]
    assert charts == ["bar chart", "line chart"]


def test_same_call_gives_identical_files(tmp_path):
    first = _files(write_scene_benchmark(tmp_path / "a", per_topic=3))
    second = _files(write_scene_benchmark(tmp_path / "b", per_topic=3))
    assert first == second and len(first) == 1 + 4 * 3
    again = _files(write_scene_benchmark(tmp_path / "a", per_topic=3))  # rewriting in place
    assert again == first
    items = load_items(tmp_path / "a" / DATA_FILE)
    assert Counter(unit.topic for unit in units_of(items)) == units_per_topic(3) == {
        "captioning": 3, "shapes": 3, "charts": 3, "multi-turn": 8}
    other = _files(write_scene_benchmark(tmp_path / "c", per_topic=3, start=HELD_OUT_START + 5000))
    assert other[DATA_FILE] != first[DATA_FILE]


@pytest.mark.parametrize("options", [{"per_topic": 0}, {"start": HELD_OUT_START - 1}])
def test_bad_arguments_are_input_errors(tmp_path, options):
    with pytest.raises(InputError):
        write_scene_benchmark(tmp_path / "x", **options)


def test_cli_writes_the_data_and_prints_the_bench_command(tmp_path, capsys):
    out = tmp_path / "demo data"
    assert main(["demo-vlm-data", "--out", str(out), "--per-topic", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert str(out) in lines[0] and "4 items" in lines[0] and "6 units" in lines[0]
    command = shlex.split(lines[-1].removeprefix("next: "))
    assert command[:5] == ["recap", "bench", "--model", "recap-demo-vlm", "--data"] and command[5] == str(out)
    assert command[command.index("--limit") + 1] == "all"
    items = load_items(out / DATA_FILE)
    check_images(items)
    assert [item.topic for item in items] == list(TOPICS)

    with pytest.raises(SystemExit) as usage:  # argparse's usage error: one line, status 2
        main(["demo-vlm-data", "--out", str(out), "--per-topic", "0"])
    assert usage.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--per-topic" in err[0]
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["demo-vlm-data", "--out", str(blocker)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("recap: error:")
