"""Stored 16-bit weights as the kernels read them: bfloat16 and float16 bit patterns.

Why: checkpoints ship bfloat16 or float16, and a decode step is bound by streaming the
weights, so reading them as stored halves the bytes. Widening a block of weight rows into a
float32 scratch panel first (what the kernels did once) wrote and re-read every weight as
float32 through the cache, and float16 went through a 65,536-entry table gather: bfloat16
steps ran slower than float32 ones. The kernels widen in registers instead (`lanes.load`
and `lanes.fma_tail`: a zero-extend and shift for bfloat16, ``vcvtph2ps`` for float16 where
the CPU has F16C), exact since every 16-bit float is a float32.

numba has no float16 arrays on CPU, so the storage dtype names the format: ``uint16`` holds
bfloat16 bit patterns, ``int16`` float16 bit patterns (`storage` makes those views), and
the kernels choose the widening from that dtype at compile time; ``float32`` is read as is.
"""

from __future__ import annotations

import numpy as np

BFLOAT16_STORAGE = np.uint16
FLOAT16_STORAGE = np.int16


def storage(weight: np.ndarray, *, float16: bool = False) -> np.ndarray:
    """A view of ``weight`` the kernels read as its format: float32 as is; 16-bit bit
    patterns (any 16-bit integer dtype) as uint16 for bfloat16, int16 for ``float16``."""
    if weight.dtype == np.float32:
        return weight
    if weight.dtype.itemsize != 2 or weight.dtype.kind not in "iu":
        raise ValueError(f"weights must be float32 or 16-bit float bit patterns, got {weight.dtype}")
    return weight.view(FLOAT16_STORAGE if float16 else BFLOAT16_STORAGE)
