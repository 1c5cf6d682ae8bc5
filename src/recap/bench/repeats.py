"""The ``repeats`` stress set: turns whose answers repeat, restate or lightly edit earlier text.

MMSpec's shared split has no multi-turn unit whose answer copies an earlier one at length, yet
chats that quote, re-ask or revise earlier answers (editing, RAG, "say that again but ...")
are where retrieval drafting earns the most, and where a drafter that caps its chains short
loses to plain SAM. This module writes such a set, in MMSpec format, from nothing but the
shared MMSpec prompts (their questions and images, the first ``per_source`` items of the
topics in `SOURCES`) and, at bench time, the model's own answers:

- later turns are multi-turn units as in MMSpec: the bench asks them with the earlier
  questions and AR's own earlier answers, so the repeated text is the model's;
- a turn may quote an earlier answer inside the user message: ``{answer:K}`` in a turn is
  replaced by the answer to turn K of the same item (`recap.bench.data.messages_for`), so a
  "summarise this passage" turn quotes the model's own long answer.

Kinds of item (each one topic of the set, so the report shows them apart):

- ``repeat``: answer in detail, then "repeat it word for word", then once more;
- ``edit``: answer in detail, then the same answer with one light edit, then continued;
- ``quote``: answer in detail, then a user turn that quotes that answer and asks for a
  summary that copies its first sentences, then a restatement;
- ``json``: a JSON answer, then the same JSON with one change, then as a list with one change.

Deterministic: the same shared data gives the same file (the ids say which MMSpec item each
came from). ``recap bench --data repeats`` builds it under ``cache_dir()/data`` when missing;
``python -m recap.bench.repeats --out DIR`` writes it anywhere. Nothing of it is committed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from recap.bench.data import DATA_FILE, BenchItem, load_items, mmspec_path
from recap.core.persistence import temporary_path
from recap.paths import cache_dir

VERSION = 1
SOURCES = ("general vqa", "image captioning", "chart understanding", "multi-turn conversation")
"""MMSpec topics whose first questions seed the set (item by item, in file order)."""

KINDS: dict[str, tuple[str, ...]] = {
    "repeat": (
        "{q} Answer in detail, in at least five sentences.",
        "Repeat your previous answer word for word, without changing anything.",
        "Thank you. Please say exactly the same answer once more.",
    ),
    "edit": (
        "{q} Answer in detail, in at least five sentences.",
        "Write your previous answer again, unchanged, but begin it with the words \"To summarize:\".",
        "Now write it once more exactly as before, and add one more sentence at the end.",
    ),
    "quote": (
        "{q} Answer in detail, in at least five sentences.",
        "Here is a passage:\n\n\"{answer:0}\"\n\nQuote the passage's first three sentences exactly, then summarise "
        "the rest in one sentence.",
        "Restate the passage above in full, keeping its wording.",
    ),
    "json": (
        "{q} Give your answer as a JSON object with the keys \"question\", \"answer\", \"objects\" (a list of "
        "at least five things in the scene) and \"colors\" (a list).",
        "Give exactly the same JSON object again, but add the key \"confidence\" with the value 0.9.",
        "Now write the same content as a numbered list, one line per key, and change the first color to blue.",
    ),
}


def build_items(mmspec: Sequence[BenchItem], per_source: int = 1) -> list[dict]:
    """The stress set's rows (MMSpec format, images as absolute paths of the sources)."""
    rows: list[dict] = []
    for kind, turns in KINDS.items():
        for topic in SOURCES:
            sources = [item for item in mmspec if item.topic == topic][:per_source]
            for item in sources:
                question = item.turns[0].strip()
                rows.append({
                    "id": f"repeats-{kind}-{item.id}",
                    "image": str(item.image.resolve()) if item.image is not None else None,
                    "turns": [turn.replace("{q}", question) for turn in turns],
                    "category": f"from {item.id} ({item.topic})",
                    "topic": kind,
                })
    return rows


def write(out: Path, mmspec_file: Path, per_source: int = 1) -> Path:
    """Write ``out/mmspec.jsonl`` from the MMSpec file ``mmspec_file``; returns its path."""
    rows = build_items(load_items(mmspec_file), per_source)
    out.mkdir(parents=True, exist_ok=True)
    path = out / DATA_FILE
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        tmp = Path(temporary_path(path))
        try:
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def cached(mmspec_file: Path, per_source: int = 1) -> Path:
    """The set built from ``mmspec_file`` under ``cache_dir()/data`` (written when missing)."""
    digest = hashlib.sha256(f"{VERSION}:{per_source}:{Path(mmspec_file).resolve()}:".encode()
                            + Path(mmspec_file).read_bytes()).hexdigest()[:12]
    folder = cache_dir() / "data" / f"repeats-v{VERSION}-{digest}"
    path = folder / DATA_FILE
    return path if path.is_file() else write(folder, Path(mmspec_file), per_source)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recap.bench.repeats", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder to write mmspec.jsonl into")
    parser.add_argument("--mmspec", default="mmspec", help="the MMSpec data it is built from (as recap bench --data)")
    parser.add_argument("--per-source", type=int, default=1, help="MMSpec items per source topic and kind")
    args = parser.parse_args(argv)
    path = write(Path(args.out), mmspec_path(args.mmspec), args.per_source)
    print(f"wrote {path}; run: recap bench --data {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
