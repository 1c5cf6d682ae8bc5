"""What ``--data`` names: an MMSpec file (`recap.bench.data`) or the repeats stress set built
from one (`recap.bench.repeats`). Kept apart from both: building the repeats set reads MMSpec
items, so the resolver that knows both sits above them and neither imports the other."""

from __future__ import annotations

from pathlib import Path

from recap.bench import repeats
from recap.bench.data import mmspec_path


def resolve_data(spec: str | None) -> Path:
    """The jsonl file behind ``--data``: ``mmspec`` (the default folder), ``mmspec=PATH`` or
    ``PATH`` (a folder holding mmspec.jsonl, or the jsonl file itself); ``repeats`` or
    ``repeats=MMSPEC`` is the stress set `recap.bench.repeats` builds from that MMSpec data."""
    spec = (spec or "mmspec").strip()
    if spec == "repeats" or spec.startswith("repeats="):
        return repeats.cached(mmspec_path(spec[len("repeats="):] or "mmspec"))
    return mmspec_path(spec)
