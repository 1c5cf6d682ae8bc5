"""What one verification costs on this machine: t(N, L), the time to verify N packed tokens
(root included) after L cached tokens.

A speculative step pays off only when the tokens it is expected to commit outgrow what its
larger forward costs, and that curve differs by device: nearly flat up to ~64 tokens on a
GPU, 4-5x one token at 64 on a small CPU. `CostProfile` holds a measured grid (sizes x
context lengths) and interpolates it; `recap.verifier.profile` measures and caches it, and
`CostProfile.flat()` simulates free verification. Online, each real verification's time
nudges a per-size correction (`observe`), so a profile measured under other load or at
other context lengths drifts towards what the run actually sees.

Numpy only (no torch): proposers read it, the target side measures it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

PROFILE_VERSION = 2
DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
"""Packed-token counts measured by `recap calibrate` (root included)."""


class ProfileError(ValueError):
    """A profile file or object that cannot be used (corrupt, wrong version, wrong shape)."""


@dataclass
class CostProfile:
    """Verify times ``times[c, s]`` (seconds) for ``sizes[s]`` packed tokens after
    ``contexts[c]`` cached tokens. Between grid points times are interpolated linearly
    (in size and in context length); beyond the largest size the last segment's slope
    continues; beyond the context range the nearest two contexts' slope continues, never
    going below the smallest measured time."""

    sizes: np.ndarray
    contexts: np.ndarray
    times: np.ndarray
    key: dict = field(default_factory=dict)
    """What the profile was measured for (model, dtype, threads, device, cpu, torch)."""
    source: str = "measured"
    """``measured``, ``flat``, ``file`` or ``default``."""
    correction_rate: float = 0.1
    """Weight of one observed verification in the running per-size correction."""
    row_block: int = 1
    """Packed sizes past 2 are computed in blocks of this many rows (the fast kernels pad a
    step to a multiple of 4, `recap.verifier.kernels.linear.padded_rows`): the cost is then a
    staircase, the same for every size of one block, and the grid is read as the cost of
    each measured size's whole block (1: none). Fixed at construction (`dataclasses.replace`
    for another)."""

    def __post_init__(self) -> None:
        self.sizes = np.asarray(self.sizes, dtype=np.float64).reshape(-1)
        self.contexts = np.asarray(self.contexts, dtype=np.float64).reshape(-1)
        self.times = np.asarray(self.times, dtype=np.float64)
        if self.times.ndim == 1:
            self.times = self.times[None]
        s, c = len(self.sizes), len(self.contexts)
        if s < 1 or c < 1 or self.times.shape != (c, s):
            raise ProfileError(f"times must be (contexts, sizes) = ({c}, {s}), got {self.times.shape}")
        if np.any(np.diff(self.sizes) <= 0) or np.any(np.diff(self.contexts) <= 0) or self.sizes[0] < 1:
            raise ProfileError("sizes and contexts must be strictly increasing, sizes from 1 up")
        if not np.all(np.isfinite(self.times)) or np.any(self.times <= 0):
            raise ProfileError("times must be finite and positive")
        if not isinstance(self.row_block, (int, np.integer)) or self.row_block < 1:
            raise ProfileError(f"row_block must be a positive integer, got {self.row_block!r}")
        self._grid = self._block_grid()
        """(sizes, times) by computed rows: what `predict` interpolates, built once."""
        self._correction = np.ones(s, dtype=np.float64)
        self._floor = float(self.times.min())
        self._observed = 0
        self._curve_key: tuple = ()
        self._curve = np.zeros(0)

    # ----------------------------------------------------------------- construction
    @classmethod
    def flat(cls, seconds: float = 1.0) -> CostProfile:
        """Verification costs the same at every size: where the paper's large trees pay off."""
        return cls(sizes=[1, 2], contexts=[0], times=[[seconds, seconds]], source="flat", correction_rate=0.0)

    @classmethod
    def linear(cls, slope: float, seconds: float = 1.0, max_size: int = 128) -> CostProfile:
        """t(N) = seconds * (1 + slope * (N - 1)): a synthetic curve for tests and defaults."""
        sizes = np.array([1, max_size], dtype=np.float64)
        return cls(sizes=sizes, contexts=[0], times=[seconds * (1 + slope * (sizes - 1))], source="default",
                   correction_rate=0.0)

    # ----------------------------------------------------------------- prediction
    def predict(self, n_packed: int | Sequence[int] | np.ndarray, context_len: int = 0) -> np.ndarray:
        """Predicted seconds for each packed size in ``n_packed`` at ``context_len`` cached
        tokens, with the online correction applied."""
        n = np.asarray(n_packed, dtype=np.float64)
        sizes, times = self._grid
        per_context = np.array([_interp_extrap(self._blocked(n), sizes, row) for row in times])
        if len(self.contexts) == 1:
            base = per_context[0]
        else:
            base = _interp_rows(float(context_len), self.contexts, per_context)
        correction = np.interp(n, self.sizes, self._correction)
        return np.maximum(base * correction, self._floor * 1e-3)

    def _blocked(self, n: np.ndarray) -> np.ndarray:
        """The rows a step of ``n`` packed tokens computes (``row_block`` padding past 2)."""
        block = self.row_block
        return n if block == 1 else np.where(n > 2, np.ceil(n / block) * block, n)

    def _block_grid(self) -> tuple[np.ndarray, np.ndarray]:
        """The grid by computed rows: sizes of one block merge into one point, the slowest
        measurement of the block (so 33 and 36 packed tokens cost what 33 measured); then
        each context's row made non-decreasing (`_non_decreasing`): on these kernels more
        rows are strictly more work, so a dip is measurement noise (a busy VM gave t(36 rows)
        178 ms after t(32 rows) 198), and a dip would make the chooser aim at it."""
        if self.row_block == 1:
            return self.sizes, self.times
        rows = self._blocked(self.sizes)
        unique, index = np.unique(rows, return_inverse=True)
        times = np.full((len(self.contexts), len(unique)), -np.inf)
        np.maximum.at(times, (slice(None), index), self.times)
        return unique, np.array([_non_decreasing(row) for row in times])

    def curve(self, max_packed: int, context_len: int = 0) -> np.ndarray:
        """``predict(1 .. max_packed)``, reused while the context length stays within the same
        32 tokens and fewer than 8 observations arrived: what a per-step choice reads."""
        key = (context_len // 32, self._observed // 8)
        if key != self._curve_key or len(self._curve) < max_packed:
            self._curve = self.predict(np.arange(1, max(max_packed, 128) + 1), context_len)
            self._curve_key = key
        return self._curve[:max_packed]

    def relative(self, n_packed: int | Sequence[int] | np.ndarray, context_len: int = 0) -> np.ndarray:
        """``predict`` divided by the one-token time at the same context length."""
        return self.predict(n_packed, context_len) / self.predict(1, context_len)

    def observe(self, n_packed: int, context_len: int, seconds: float) -> None:
        """Blend one measured verification into the correction of the nearest grid size."""
        if self.correction_rate <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            return
        base = float(self.predict(n_packed, context_len)) / float(np.interp(n_packed, self.sizes, self._correction))
        index = int(np.abs(self.sizes - n_packed).argmin())
        ratio = min(max(seconds / base, 0.25), 4.0)  # one stall must not rewrite the curve
        rate = self.correction_rate
        self._correction[index] = (1 - rate) * self._correction[index] + rate * ratio
        self._observed += 1

    # ----------------------------------------------------------------- files
    def to_dict(self) -> dict:
        return {"version": PROFILE_VERSION, "key": self.key, "source": self.source,
                "sizes": self.sizes.astype(int).tolist(), "contexts": self.contexts.astype(int).tolist(),
                "times": self.times.tolist(), "row_block": int(self.row_block)}

    @classmethod
    def from_dict(cls, data: dict) -> CostProfile:
        if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
            raise ProfileError(f"not a version-{PROFILE_VERSION} cost profile")
        try:
            return cls(sizes=data["sizes"], contexts=data["contexts"], times=data["times"], key=dict(data["key"]),
                       source=str(data.get("source", "file")), row_block=data.get("row_block", 1))
        except (KeyError, TypeError, ValueError) as error:
            raise ProfileError(f"malformed cost profile: {error}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> CostProfile:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ProfileError(f"cost profile is not JSON: {error}") from None
        return cls.from_dict(data)

    def describe(self, context_len: int | None = None) -> str:
        """One line: t(N)/t(1) at a few sizes."""
        context = int(self.contexts[0]) if context_len is None else context_len
        sizes = [n for n in (2, 5, 17, 33, 65) if n <= self.sizes[-1] or self.source == "flat"]
        ratios = ", ".join(f"{n}: {r:.2f}x" for n, r in zip(sizes, self.relative(sizes, context)))
        return f"{self.source} profile, t(N)/t(1) at context {context}: {ratios}"


def _non_decreasing(values: np.ndarray) -> np.ndarray:
    """The closest non-decreasing sequence in least squares (pool adjacent violators): each
    run that dips is replaced by its mean, so noise is averaged out, not clipped upwards."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for value in np.asarray(values, dtype=np.float64):
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return np.concatenate([np.full(int(count), total / count) for total, count in blocks])


def _interp_extrap(x: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Linear interpolation; past the last point the slope from the last lower point
    continues (the last segment's, unless noise or pooling left the end flat or dipping)."""
    if len(xs) == 1:
        return np.full_like(x, ys[0], dtype=np.float64)
    inside = np.interp(x, xs, ys)
    lower = np.flatnonzero(ys[:-1] < ys[-1])
    k = int(lower[-1]) if len(lower) else len(xs) - 2
    slope = max(0.0, (ys[-1] - ys[k]) / (xs[-1] - xs[k]))
    return np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), inside)


def _interp_rows(context: float, contexts: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Interpolate (or extrapolate, linearly, from the two nearest) rows over context length."""
    i = int(np.clip(np.searchsorted(contexts, context) - 1, 0, len(contexts) - 2))
    c0, c1 = contexts[i], contexts[i + 1]
    w = (context - c0) / (c1 - c0)
    mixed = (1 - w) * rows[i] + w * rows[i + 1]
    return np.maximum(mixed, np.minimum(rows[i], rows[i + 1]) if w < 0 else mixed)
