"""Stage timers a proposer keeps on itself, so a profiler reports the split of the real call.

`recap overhead` times ``propose`` and ``observe`` from outside; what happens inside them is
only known to the proposer. A proposer that wants its parts reported records them here while
it runs (a few clock reads per call, well under a microsecond), and the profiler reads
`StageTimer.last` after each call instead of re-running the parts itself.
"""

from __future__ import annotations

import time


class StageTimer:
    """Seconds of the named parts of the latest call of each kind (``propose``, ``observe``).

    ``begin(call)`` starts a call and forgets that call's previous parts; ``lap(part)`` adds
    the time since the previous mark to ``part`` (a part may be lapped more than once in a
    call: its times add up)."""

    def __init__(self) -> None:
        self.last: dict[str, dict[str, float]] = {}
        self._current: dict[str, float] = {}
        self._mark = 0.0

    def begin(self, call: str) -> None:
        self._current = self.last[call] = {}
        self._mark = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self._current[part] = self._current.get(part, 0.0) + (now - self._mark)
        self._mark = now
