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

import functools

import numpy as np
from llvmlite import ir

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


@functools.cache
def compiles_for(feature: str) -> bool:
    """Whether the CPU numba compiles for has ``feature`` (an LLVM name such as ``f16c``):
    the host's, or those ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` name."""
    from numba.core.registry import cpu_target

    features = cpu_target.target_context.codegen()._tm_features
    return f"+{feature}" in features.split(",")


def half_to_float(builder: ir.IRBuilder, raw: ir.Value) -> ir.Value:
    """float16 bit patterns (an i16 or a vector of them) widened to float32, exactly. With
    F16C one ``vcvtph2ps``; without it (a baseline x86-64 build) LLVM would call a runtime
    helper numba does not link, so the bits are rebuilt with integer operations: the sign,
    the exponent rebiased (15 -> 127), the 10 mantissa bits moved up; infinities and NaNs
    keep an all-ones exponent; subnormals are their mantissa times 2**-24 (exact)."""
    vector = isinstance(raw.type, ir.VectorType)
    count = raw.type.count if vector else 1
    floats = ir.VectorType(ir.FloatType(), count) if vector else ir.FloatType()
    if compiles_for("f16c"):
        return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), count) if vector else ir.HalfType()),
                             floats)
    ints = ir.VectorType(ir.IntType(32), count) if vector else ir.IntType(32)

    def const(value):
        return ir.Constant(ints, [value] * count if vector else value)

    wide = builder.zext(raw, ints)
    sign = builder.shl(builder.and_(wide, const(0x8000)), const(16))
    exponent = builder.and_(builder.lshr(wide, const(10)), const(0x1F))
    mantissa = builder.and_(wide, const(0x3FF))
    moved = builder.shl(mantissa, const(13))
    normal = builder.or_(builder.shl(builder.add(exponent, const(112)), const(23)), moved)
    special = builder.or_(const(0x7F800000), moved)
    tiny = builder.bitcast(builder.fmul(builder.uitofp(mantissa, floats),
                                        ir.Constant(floats, [2.0 ** -24] * count if vector else 2.0 ** -24)), ints)
    magnitude = builder.select(builder.icmp_unsigned("==", exponent, const(0)), tiny,
                               builder.select(builder.icmp_unsigned("==", exponent, const(31)), special, normal))
    return builder.bitcast(builder.or_(sign, magnitude), floats)
