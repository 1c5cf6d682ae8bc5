"""Numba compiles inside a timed decode: recorded with the row, flagged in the report.

A timed unit should measure the steady state. On a cold numba cache (a clean checkout, the
first run after a kernel edit) a decode can compile a kernel the warm-up did not reach, and
seconds of compiling land inside its time (docs/measurements.md, 2026-12-07). numba
announces every real compile (a cache miss) as a ``numba:compile`` event; `CompileWatch`
counts them and their time around one decode, so the row says what ran, and a run whose timed
units compiled is flagged instead of silently reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from numba.core import event


@dataclass
class CompileWatch(event.Listener):
    """Counts the numba compiles (cache misses) that start and end inside a ``with`` block,
    with their wall time and the functions compiled. Loading a compiled function from
    numba's cache is not counted: it takes milliseconds, not seconds."""

    count: int = 0
    seconds: float = 0.0
    names: list[str] = field(default_factory=list)
    _started: list[float] = field(default_factory=list)

    def on_start(self, ev: event.Event) -> None:
        self._started.append(time.perf_counter())

    def on_end(self, ev: event.Event) -> None:
        began = self._started.pop() if self._started else time.perf_counter()
        if self._started:  # a compile nested in another (an inlined callee): counted once, by the outer one
            return
        self.count += 1
        self.seconds += time.perf_counter() - began
        dispatcher = (ev.data or {}).get("dispatcher")
        self.names.append(getattr(getattr(dispatcher, "py_func", None), "__qualname__", repr(dispatcher)))

    def __enter__(self) -> CompileWatch:
        event.register("numba:compile", self)
        return self

    def __exit__(self, *exc) -> None:
        event.unregister("numba:compile", self)

    def fields(self) -> dict:
        """What a result row records: ``compiles`` and ``compile_s`` (and ``compiled``, the
        functions, where any)."""
        row: dict = {"compiles": self.count, "compile_s": round(self.seconds, 6)}
        if self.names:
            row["compiled"] = self.names[:20]
        return row


def compiled_units(rows: list[dict]) -> list[dict]:
    """The rows whose timed decode compiled numba code: unit, method, compiles, seconds."""
    return [{"unit": row["unit"], "method": row["method"], "compiles": row["compiles"],
             "compile_s": row.get("compile_s", 0.0)} for row in rows if row.get("compiles")]


WARNING = ("numba compiled code inside {count} timed decode(s) ({seconds:.1f} s in all): a cold numba cache or "
           "the first run after a kernel edit; their times include compiling, so rerun the same command in a new "
           "folder (the cache is warm now) before quoting this run")
