"""Exact widening of stored weights to float32 inside the linear kernels' inner loops.

Why: checkpoints ship bfloat16 or float16, and a decode step is bound by streaming the
weights, so reading them as stored halves the bytes. Widening a block of weight rows into a
float32 scratch panel first (what the kernels did before) wrote and re-read every weight as
float32 through the cache, and float16 went through a 65,536-entry table gather: bfloat16
steps ran slower than float32 ones. Widened in registers instead, the dot product is the
same arithmetic on the same float32 values (every 16-bit float is exactly a float32), so the
bits do not change; LLVM vectorises both conversions (a zero-extend and shift for bfloat16,
``vcvtph2ps`` for float16 where the CPU has F16C).

numba has no float16 arrays on CPU, so the storage dtype names the format: ``uint16`` holds
bfloat16 bit patterns, ``int16`` float16 bit patterns (`storage` makes those views), and
`widen` dispatches on that dtype at compile time; ``float32`` passes through unchanged.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

BFLOAT16_STORAGE = np.uint16
FLOAT16_STORAGE = np.int16


@intrinsic
def _bfloat16_to_float32(typingctx, bits):  # pragma: no cover - compiled
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        wide = builder.zext(args[0], ir.IntType(32))
        return builder.bitcast(builder.shl(wide, ir.Constant(ir.IntType(32), 16)), ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _float16_to_float32(typingctx, bits):  # pragma: no cover - compiled
    if bits != types.int16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


def widen(value):  # pragma: no cover - replaced in compiled code by the overload below
    """A stored weight as float32: float32 as is, bfloat16 / float16 bits exactly widened."""
    raise NotImplementedError("widen runs inside numba-compiled kernels only")


@overload(widen, inline="always")
def _widen(value):  # pragma: no cover - compiled
    if value == types.float32:
        return lambda value: value
    if value == types.uint16:
        return lambda value: _bfloat16_to_float32(value)
    if value == types.int16:
        return lambda value: _float16_to_float32(value)
    return None


def storage(weight: np.ndarray, *, float16: bool = False) -> np.ndarray:
    """A view of ``weight`` the kernels read as its format: float32 as is; 16-bit bit
    patterns (any 16-bit integer dtype) as uint16 for bfloat16, int16 for ``float16``."""
    if weight.dtype == np.float32:
        return weight
    if weight.dtype.itemsize != 2 or weight.dtype.kind not in "iu":
        raise ValueError(f"weights must be float32 or 16-bit float bit patterns, got {weight.dtype}")
    return weight.view(FLOAT16_STORAGE if float16 else BFLOAT16_STORAGE)
