"""The bench's dominance check (does recap keep up with the best other method, per topic and
per unit) and the ``repeats`` stress set (issue 20's tooling)."""

from __future__ import annotations

import json

import pytest

from recap.bench import repeats
from recap.bench.data import Unit, load_items, messages_for, mmspec_path, quote_answers
from recap.bench.dominance import dominance, markdown_section
from recap.errors import InputError


def _row(unit, method, topic, n, time_s, accepted, iterations):
    return {"unit": unit, "topic": topic, "method": method, "n_tokens": n, "time_s": time_s,
            "accepted": accepted, "iterations": iterations, "item": unit.split("#")[0]}


def test_dominance_table():
    rows = []
    for unit, topic, recap_t, sam_t in (("a#0", "t1", 1.0, 2.0), ("b#0", "t1", 1.0, 1.05), ("c#0", "t2", 1.0, 1.5)):
        rows += [_row(unit, "ar", topic, 64, 4.0, 0, 63), _row(unit, "recap", topic, 64, recap_t, 50, 14),
                 _row(unit, "sam", topic, 64, sam_t, 60, 4), _row(unit, "pld", topic, 64, 3.0, 10, 50)]
    check = dominance(rows)
    assert check["topics"]["t1"]["best"] == "sam"  # S: recap 4x on a, b; sam 2x, 3.81x
    assert check["topics"]["t1"]["ratio"] > 1
    assert check["topics"]["t2"]["best"] == "sam" and check["topics"]["t2"]["ratio"] == pytest.approx(1.5)
    slow = dominance([r for r in rows if r["method"] != "recap"] +
                     [_row("a#0", "recap", "t1", 64, 4.0, 0, 63)])
    assert [u["unit"] for u in slow["units"]] == ["a#0"]
    unit = slow["units"][0]
    assert unit["best"] == "sam" and unit["steps"] == 63 and unit["best_steps"] == 4
    assert unit["tau"] == pytest.approx(1.0) and unit["best_tau"] == pytest.approx(16.0)
    text = "\n".join(markdown_section(slow))
    assert "a#0" in text and "behind" in text
    assert dominance([r for r in rows if r["method"] in ("ar", "recap")]) is None


def test_quoted_answers_fill_in_and_bad_references_are_clear_errors():
    assert quote_answers("Summarise: {answer:0}", ["  A long answer. "]) == "Summarise: A long answer."
    assert quote_answers("no quote here", []) == "no quote here"
    with pytest.raises(InputError, match="answer:1"):
        quote_answers("{answer:1}", ["only one"])


def test_repeats_set_is_built_deterministically_from_the_shared_prompts(tmp_path):
    mmspec = mmspec_path("mmspec")
    first = repeats.write(tmp_path / "a", mmspec)
    second = repeats.write(tmp_path / "b", mmspec)
    assert first.read_bytes() == second.read_bytes()
    items = load_items(first)
    assert {item.topic for item in items} == {"repeat", "edit", "quote", "json"}
    assert all(len(item.turns) == 3 for item in items)
    quote = next(item for item in items if item.topic == "quote")
    unit = Unit(item=quote, turn=1)
    messages = messages_for(unit, ["The earlier answer, word for word."])
    assert "The earlier answer, word for word." in messages[-1]["content"]
    assert json.loads(first.read_text().splitlines()[0])["id"]
