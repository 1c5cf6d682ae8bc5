"""The kernels' thread count: torch's, read at every step, and never changed behind a caller.

Why this exists: numba's parallel pool, when it starts, sets the process's OpenMP thread
count to the core count, and torch reads that count as its own. Started by the first
parallel kernel (a layer's check at load), it silently turned a caller's
``torch.set_num_threads(1)`` into 2 threads for torch and the kernels alike. `start_pool`
starts it at a known moment and puts torch's count back; `follow_torch` then runs the
kernels on exactly torch's count (as far as numba's pool reaches) and says how many ran.
"""

from __future__ import annotations

import threading

import numba
import torch

_started = False
_lock = threading.Lock()


def start_pool() -> None:
    """Start numba's thread pool now (once per process), leaving torch's thread count as it
    was before. A pool the caller's own numba code started earlier is left as it is."""
    global _started
    if _started:
        return
    with _lock:
        if _started:
            return
        threads = torch.get_num_threads()
        try:
            numba.get_num_threads()  # launches the pool on its first call
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            _started = True


def follow_torch() -> int:
    """Run this thread's kernels on torch's thread count, capped by numba's pool
    (``NUMBA_NUM_THREADS``, the core count unless set); returns the count they run on."""
    start_pool()
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)
    return threads


def kernel_threads() -> int:
    """The thread count this thread's kernels ran on last (numba's, read back)."""
    start_pool()
    return numba.get_num_threads()


def read_back(kernels: str) -> dict[str, int | None]:
    """The thread counts a measurement ran on, read after it: torch's, and the fast
    kernels' (None on the stock kernels, which run on torch's)."""
    return {"torch": torch.get_num_threads(), "kernels": kernel_threads() if kernels == "fast" else None}


def check_read_back(asked: int, ran: dict[str, int | None], what: str) -> None:
    """Refuse (`RecapError`) a result whose read-back thread counts differ from ``asked``."""
    from recap.errors import RecapError

    wrong = {name: count for name, count in ran.items() if count is not None and count != asked}
    if wrong:
        ran_on = ", ".join(f"{name} {count}" for name, count in wrong.items())
        raise RecapError(f"{what} asked for {asked} thread(s) but ran on {ran_on} (NUMBA_NUM_THREADS or the "
                         "core count caps the kernels): not written")
