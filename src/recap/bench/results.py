"""results.jsonl and run.json in the output folder: written as the run goes, safe to interrupt.

The rows of one unit (AR and every method) are appended in one write, flushed and synced
while Ctrl-C is held back, so the file always ends with whole units and a rerun skips them.
A last line cut short by a hard kill is dropped on load (that unit simply runs again).
``run.json`` holds the settings a resume must share (model, dtype, threads, methods...): a
rerun with different settings into the same folder is refused instead of mixing results.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from recap.core.persistence import temporary_path
from recap.errors import InputError

RESULTS = "results.jsonl"
RUN = "run.json"


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold back SIGINT inside the block and raise KeyboardInterrupt after it, so a write
    is never cut in half by Ctrl-C. Outside the main thread signals cannot be handled; the
    block then runs unprotected."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield  # no handler possible, or Ctrl-C ignored anyway (a background job)
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda *_: received.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def write_json_atomic(path: Path, data: object) -> None:
    """Write JSON through a temporary file and a rename: readers never see half a file."""
    temporary = Path(temporary_path(path))
    try:
        temporary.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


class ResultsFile:
    """Append-only results.jsonl of one output folder."""

    def __init__(self, out: Path):
        self.path = Path(out) / RESULTS

    def load(self) -> list[dict]:
        """Every whole row. Our writes end with a newline, so a last line without one was
        torn by a hard kill: it is cut off the file. Any other bad line is an error (the
        file was edited or is not ours)."""
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            data = data[: data.rfind(b"\n") + 1]
            with open(self.path, "r+b") as handle:
                handle.truncate(len(data))
        rows: list[dict] = []
        for number, line in enumerate(data.split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict):
                raise InputError(f"{self.path}:{number} is not a results row; the file is damaged "
                                 "(move it away to start over)")
            rows.append(row)
        return rows

    def append(self, rows: Sequence[dict]) -> None:
        """Append ``rows`` as one write, flushed and synced before Ctrl-C is honoured."""
        text = "".join(json.dumps(row) + "\n" for row in rows)
        with interrupts_held(), open(self.path, "a", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())


def check_settings(out: Path, settings: dict, has_rows: bool) -> dict:
    """The run record of ``out``: created for a new run (or one that finished no unit),
    checked against ``settings`` on a resume (a mismatch is an `InputError` naming the
    differing settings)."""
    path = Path(out) / RUN
    if path.exists() and has_rows:
        try:
            record = json.loads(path.read_text())
            stored = record["settings"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InputError(f"{path} is damaged; move the folder away to start over") from None
        differing = [f"{key} {stored.get(key)!r} -> {settings.get(key)!r}"
                     for key in sorted(set(stored) | set(settings)) if stored.get(key) != settings.get(key)]
        if differing:
            raise InputError(f"{out} holds results of a run with other settings ({'; '.join(differing)}); "
                             "use another --out or move that folder away")
        return record
    if has_rows:
        raise InputError(f"{out} has {RESULTS} but no {RUN}; use another --out or move that folder away")
    return {"settings": settings, "sessions": []}
