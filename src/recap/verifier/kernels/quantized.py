"""GGUF weight blocks as the kernels read them: stored, de-quantised in registers.

Why: a decode step streams every weight once, so its cost follows the bytes it reads. A
GGUF file stores SmolLM2 in 4.5- and 8.5-bit blocks; the float32 model transformers builds
from it streams 5.6x those bytes a step. Reading the blocks as stored and widening each
group of `lanes.LANES` weights in registers reads the file's bytes instead.

Exact by construction: transformers builds its float weights with the ``gguf`` package's
numpy de-quantisation, one float32 operation at a time, each rounded. The code below gives
each weight the same float32: the same operations in the same order, except that a
multiply followed by an add is one fused multiply-add where the product is exact in float32
(`_scale_and_shift`: then rounding it first changes nothing; a product that can round, Q6_K's,
stays a separate multiply). So every weight a kernel multiplies is the very float32 the
float path multiplies, and the dot product after it (`lanes` order) gives the same bits.
``tests/test_quantized.py`` holds every format to ``gguf.dequantize`` on random and real
blocks; a wrongly widened scale and a wrong nibble order are its negative controls.

Storage: a tensor of N rows of K weights is a numpy array of shape (N, K / block size) whose
dtype is the format's block record (`FORMATS`), a view of the file's bytes (no copy); numba
sees the record dtype and the kernels pick the de-quantisation at compile time, as `widen`
picks the 16-bit widening from the storage dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.np.numpy_support import as_dtype

from recap.verifier.kernels import llvm_ops, widen

_FLOAT = ir.FloatType()
_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)


@dataclass(frozen=True)
class Format:
    """One GGUF block format: its name (``gguf.GGMLQuantizationType``), the weights a block
    holds and the block's record dtype (field names carry the format, so no two formats'
    dtypes are equal)."""

    name: str
    block: int
    dtype: np.dtype


def _record(name: str, *fields: tuple) -> np.dtype:
    return np.dtype([(f"{name}_{field}", *rest) for field, *rest in fields])


FORMATS = {
    "Q8_0": Format("Q8_0", 32, _record("q8_0", ("d", "<u2"), ("qs", "i1", (32,)))),
    "Q4_0": Format("Q4_0", 32, _record("q4_0", ("d", "<u2"), ("qs", "u1", (16,)))),
    "Q4_1": Format("Q4_1", 32, _record("q4_1", ("d", "<u2"), ("m", "<u2"), ("qs", "u1", (16,)))),
    "Q5_0": Format("Q5_0", 32, _record("q5_0", ("d", "<u2"), ("qh", "<u4"), ("qs", "u1", (16,)))),
    "Q5_1": Format("Q5_1", 32, _record("q5_1", ("d", "<u2"), ("m", "<u2"), ("qh", "<u4"), ("qs", "u1", (16,)))),
    "Q4_K": Format("Q4_K", 256, _record("q4_k", ("d", "<u2"), ("dmin", "<u2"), ("scales", "u1", (12,)),
                                        ("qs", "u1", (128,)))),
    "Q5_K": Format("Q5_K", 256, _record("q5_k", ("d", "<u2"), ("dmin", "<u2"), ("scales", "u1", (12,)),
                                        ("qh", "u1", (32,)), ("qs", "u1", (128,)))),
    "Q6_K": Format("Q6_K", 256, _record("q6_k", ("ql", "u1", (128,)), ("qh", "u1", (64,)), ("scales", "i1", (16,)),
                                        ("d", "<u2"))),
}
"""The formats the kernels read as stored, by GGUF type name."""

_BY_DTYPE = {format.dtype: format for format in FORMATS.values()}


def format_of(dtype: np.dtype) -> Format | None:
    """The block format a storage dtype holds (None: not a block format)."""
    return _BY_DTYPE.get(np.dtype(dtype))


def numba_format(dtype: types.Type) -> Format | None:
    """The block format of a numba array element type (None: not a block format)."""
    if not isinstance(dtype, types.Record):
        return None
    return format_of(as_dtype(dtype))


def blocks(raw: np.ndarray, name: str) -> np.ndarray:
    """The stored rows ``raw`` (uint8, shape (N, bytes per row): a GGUF tensor's data, as
    ``gguf.GGUFReader`` maps it) as an (N, K / block) array of ``name``'s blocks, no copy."""
    if name not in FORMATS:
        raise ValueError(f"GGUF type {name} is not read as stored (these are: {', '.join(FORMATS)})")
    format = FORMATS[name]
    raw = np.ascontiguousarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % format.dtype.itemsize:
        raise ValueError(f"{name} rows must be uint8 of a multiple of {format.dtype.itemsize} bytes, "
                         f"got {raw.dtype} {raw.shape}")
    return raw.view(format.dtype)


def weights_per_row(stored: np.ndarray) -> int:
    """K of a stored block tensor (blocks per row x weights per block)."""
    format = format_of(stored.dtype)
    assert format is not None, stored.dtype
    return stored.shape[1] * format.block


def dequantize(stored: np.ndarray) -> np.ndarray:
    """The float32 weights of a stored block tensor, by the ``gguf`` package (the reference
    transformers loads with)."""
    import gguf

    format = format_of(stored.dtype)
    assert format is not None, stored.dtype
    raw = np.ascontiguousarray(stored).view(np.uint8).reshape(len(stored), -1)
    return gguf.dequantize(raw, gguf.GGMLQuantizationType[format.name]).reshape(len(stored), -1)


def random_blocks(rng: np.random.Generator, rows: int, columns: int, name: str) -> np.ndarray:
    """Seeded random ``name`` blocks for (rows, columns) weights: random bits everywhere (every
    nibble and high-bit pattern), float16 scales random finite numbers, about 1 in 8 of them
    subnormal (the cases a widening must get exactly right)."""
    format = FORMATS[name]
    raw = rng.integers(0, 256, (rows, columns // format.block * format.dtype.itemsize), dtype=np.uint8)
    stored = blocks(raw, name).copy()
    for field in stored.dtype.names:
        if field.endswith(("_d", "_m", "_dmin")):
            scales = (rng.standard_normal(stored.shape) * 0.01).astype(np.float16)
            subnormal = rng.random(stored.shape) < 0.125
            scales[subnormal] = (rng.integers(-1023, 1024, int(subnormal.sum())) * 2.0 ** -24).astype(np.float16)
            stored[field] = scales.view(np.uint16)
    return stored


# --------------------------------------------------------------------------- code generation
def _at(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value | int, kind: ir.Type) -> ir.Value:
    """A value of type ``kind`` at ``base + offset`` bytes (any alignment)."""
    if isinstance(offset, int):
        offset = _intp(offset)
    pointer = builder.gep(base, [offset], source_etype=_I8)
    return builder.load(builder.bitcast(pointer, kind.as_pointer()), align=1)


def _half(builder: ir.IRBuilder, base: ir.Value, offset: int) -> ir.Value:
    """The float16 at ``base + offset`` widened to float32 (exact)."""
    return widen.half_to_float(builder, _at(builder, base, offset, _I16))


def _intp(value: int) -> ir.Constant:
    return ir.Constant(cgutils.intp_t, value)


def _bytes(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value, count: int, shift: ir.Value, mask: int) -> ir.Value:
    """``count`` bytes from ``base + offset`` as int32, each shifted right by ``shift`` (an
    intp value) and masked with ``mask``."""
    raw = builder.zext(_at(builder, base, offset, ir.VectorType(_I8, count)), ir.VectorType(_I32, count))
    shifted = builder.lshr(raw, llvm_ops.broadcast(builder, builder.trunc(shift, _I32), count))
    return builder.and_(shifted, ir.Constant(ir.VectorType(_I32, count), [mask] * count))


def _nibbles(builder: ir.IRBuilder, base: ir.Value, start: int, group: ir.Value, count: int) -> ir.Value:
    """The 4-bit values of weights 8 group .. 8 group + 7 of a 32-weight block whose 16 bytes
    start at ``base + start``: weights 0-15 are the bytes' low nibbles, 16-31 their high
    ones (as ``gguf`` orders them); a vector of ``count`` int32."""
    # groups 0 and 2 read bytes 0-7, groups 1 and 3 bytes 8-15; groups 2 and 3 the high nibbles
    bytes_from = builder.add(_intp(start), builder.mul(builder.and_(group, _intp(1)), _intp(8)))
    return _bytes(builder, base, bytes_from, count, builder.mul(builder.lshr(group, _intp(1)), _intp(4)), 0x0F)


def _fifth_bits(builder: ir.IRBuilder, base: ir.Value, start: int, group: ir.Value, count: int) -> ir.Value:
    """Bit 4 of weights 8 group .. 8 group + 7 (bit j of the little-endian uint32 at
    ``base + start`` is weight j's), as int32 values 0 or 16."""
    bits = _at(builder, base, start, _I32)
    byte = builder.lshr(bits, builder.trunc(builder.mul(group, _intp(8)), _I32))
    masks = ir.Constant(ir.VectorType(_I32, count), [1 << j for j in range(count)])
    set_ = builder.icmp_unsigned("!=", builder.and_(llvm_ops.broadcast(builder, byte, count), masks),
                                 ir.Constant(ir.VectorType(_I32, count), [0] * count))
    return builder.shl(builder.zext(set_, ir.VectorType(_I32, count)), ir.Constant(ir.VectorType(_I32, count),
                                                                                     [4] * count))


def _scale_and_shift(builder: ir.IRBuilder, d: ir.Value, q: ir.Value, m: ir.Value) -> ir.Value:
    """``gguf``'s ``(d * q) + m``, as one fused multiply-add: the same bits, because ``d * q``
    is exact in float32 (d a float16, 11 significant bits; |q| <= 32, 6 bits: at most 17
    significant bits, and no float16 is small enough to leave float32's normal range), so
    rounding it first changes nothing (``tests/test_quantized.py`` checks every float16)."""
    return llvm_ops.fma(builder, d, q, m)


def dequantize_group(builder: ir.IRBuilder, format: Format, block: ir.Value, group: ir.Value,
                     count: int) -> ir.Value:
    """Weights 8 group .. 8 group + count - 1 of the block at ``block`` (an i8 pointer) as a
    float32 vector, by ``gguf``'s operations in ``gguf``'s order (see the module docstring)."""
    vector = ir.VectorType(_FLOAT, count)
    ints = ir.VectorType(_I32, count)
    if format.name == "Q8_0":  # x * d
        offset = builder.add(_intp(2), builder.mul(group, _intp(8)))
        values = builder.sitofp(_at(builder, block, offset, ir.VectorType(_I8, count)), vector)
        return builder.fmul(values, llvm_ops.broadcast(builder, _half(builder, block, 0), count))
    if format.name == "Q4_0":  # d * (q - 8)
        q = builder.sub(_nibbles(builder, block, 2, group, count), ir.Constant(ints, [8] * count))
        return builder.fmul(llvm_ops.broadcast(builder, _half(builder, block, 0), count), builder.sitofp(q, vector))
    if format.name == "Q4_1":  # (d * q) + m
        q = builder.uitofp(_nibbles(builder, block, 4, group, count), vector)
        return _scale_and_shift(builder, llvm_ops.broadcast(builder, _half(builder, block, 0), count), q,
                                llvm_ops.broadcast(builder, _half(builder, block, 2), count))
    if format.name == "Q5_0":  # d * ((q | bit4) - 16)
        q = builder.or_(_nibbles(builder, block, 6, group, count), _fifth_bits(builder, block, 2, group, count))
        q = builder.sub(q, ir.Constant(ints, [16] * count))
        return builder.fmul(llvm_ops.broadcast(builder, _half(builder, block, 0), count), builder.sitofp(q, vector))
    if format.name == "Q5_1":  # (d * (q | bit4)) + m
        q = builder.or_(_nibbles(builder, block, 8, group, count), _fifth_bits(builder, block, 4, group, count))
        return _scale_and_shift(builder, llvm_ops.broadcast(builder, _half(builder, block, 0), count),
                                builder.uitofp(q, vector), llvm_ops.broadcast(builder, _half(builder, block, 2), count))
    raise AssertionError(format.name)  # the 256-weight K-quants are read by `_k_pass`


def _scale_byte(builder: ir.IRBuilder, block: ir.Value, offset: ir.Value) -> ir.Value:
    return builder.zext(_at(builder, block, builder.add(_intp(4), offset), _I8), _I32)


def _k_scale_min(builder: ir.IRBuilder, block: ir.Value, sub: ir.Value) -> tuple[ir.Value, ir.Value]:
    """The 6-bit scale and min of sub-block ``sub`` (0-7) of a Q4_K / Q5_K super-block, unpacked
    from its 12 scale bytes as ``gguf``'s ``get_scale_min`` does: sub-blocks 0-3 from the low
    6 bits of bytes j and j + 4; 4-7 from byte j + 4's nibbles and the top 2 bits of bytes
    j - 4 and j."""
    four = _intp(4)
    low = builder.icmp_unsigned("<", sub, four)
    first = builder.select(low, sub, builder.sub(sub, four))  # j, or j - 4
    a, b, c = (_scale_byte(builder, block, first), _scale_byte(builder, block, builder.add(first, four)),
               _scale_byte(builder, block, builder.add(first, _intp(8))))

    def const(value: int) -> ir.Constant:
        return ir.Constant(_I32, value)

    scale_low = builder.and_(a, const(0x3F))
    min_low = builder.and_(b, const(0x3F))
    scale_high = builder.or_(builder.and_(c, const(0x0F)), builder.and_(builder.lshr(a, const(2)), const(0x30)))
    min_high = builder.or_(builder.lshr(c, const(4)), builder.and_(builder.lshr(b, const(2)), const(0x30)))
    return builder.select(low, scale_low, scale_high), builder.select(low, min_low, min_high)


def _k_pass(builder: ir.IRBuilder, name: str, block: ir.Value, first: ir.Value, groups: int,
            count: int) -> list[ir.Value]:
    """Groups ``first`` .. ``first + groups - 1`` (8 weights each; ``first`` a multiple of 4,
    so one 32-weight sub-block) of a 256-weight K-quant super-block, by ``gguf``'s arithmetic.
    Q4_K / Q5_K: ``(d * scale) * q - dmin * min`` per 32-weight sub-block (every product exact
    in float32: d * scale has at most 17 significant bits, times a 5-bit q at most 22), so one
    fused multiply-add; Q6_K: ``(d * scale) * q`` per 16-weight sub-block, a plain multiply
    (that product can round). The packed scales are unpacked once for the pass, not once a
    group: LLVM cannot see that ``first`` is a multiple of 4, so it would not share them."""
    if name == "Q6_K":  # two 16-weight sub-blocks
        sub = builder.udiv(first, _intp(2))
        factors = [_q6_factor(builder, block, builder.add(sub, _intp(i)), count) for i in range(2)]
        return [_q6_values(builder, block, builder.add(first, _intp(g)), count, factors[g // 2])
                for g in range(groups)]
    factors = _k_factors(builder, block, builder.udiv(first, _intp(4)), count)
    return [_k_values(builder, name, block, builder.add(first, _intp(g)), count, factors) for g in range(groups)]


def _q6_factor(builder: ir.IRBuilder, block: ir.Value, sub: ir.Value, count: int) -> ir.Value:
    """Q6_K: 16-weight sub-block ``sub``'s ``d * scale``, broadcast to ``count`` lanes."""
    scale = builder.sitofp(_at(builder, block, builder.add(_intp(192), sub), _I8), _FLOAT)
    return llvm_ops.broadcast(builder, builder.fmul(_half(builder, block, 208), scale), count)


def _q6_values(builder: ir.IRBuilder, block: ir.Value, group: ir.Value, count: int, factor: ir.Value) -> ir.Value:
    """Q6_K weights 8 group .. 8 group + 7 given their sub-block's `_q6_factor`: ``(d * scale)
    * q``, a plain multiply (see `_k_pass`)."""
    vector = ir.VectorType(_FLOAT, count)
    ints = ir.VectorType(_I32, count)
    first = builder.mul(group, _intp(8))  # the group's first weight in the super-block
    half, within = builder.udiv(first, _intp(128)), builder.urem(first, _intp(128))
    nibble, byte = builder.udiv(within, _intp(64)), builder.urem(within, _intp(64))
    low = _bytes(builder, block, builder.add(builder.mul(half, _intp(64)), byte), count,
                 builder.mul(nibble, _intp(4)), 0x0F)
    pair, column = builder.udiv(within, _intp(32)), builder.urem(within, _intp(32))
    high = _bytes(builder, block, builder.add(_intp(128), builder.add(builder.mul(half, _intp(32)), column)),
                  count, builder.mul(pair, _intp(2)), 0x03)
    q = builder.sub(builder.or_(low, builder.shl(high, ir.Constant(ints, [4] * count))),
                    ir.Constant(ints, [32] * count))
    return builder.fmul(factor, builder.sitofp(q, vector))


def _k_factors(builder: ir.IRBuilder, block: ir.Value, sub: ir.Value, count: int) -> tuple[ir.Value, ir.Value]:
    """Q4_K / Q5_K: sub-block ``sub``'s ``d * scale`` and ``-(dmin * min)``, broadcast to
    ``count`` lanes (the same for its 4 groups of 8)."""
    scale, minimum = _k_scale_min(builder, block, sub)
    d = builder.fmul(_half(builder, block, 0), builder.uitofp(scale, _FLOAT))
    dm = builder.fmul(_half(builder, block, 2), builder.uitofp(minimum, _FLOAT))
    return llvm_ops.broadcast(builder, d, count), llvm_ops.broadcast(builder, builder.fneg(dm), count)


def _k_values(builder: ir.IRBuilder, name: str, block: ir.Value, group: ir.Value, count: int,
              factors: tuple[ir.Value, ir.Value]) -> ir.Value:
    """Q4_K / Q5_K weights 8 group .. 8 group + 7 given their sub-block's `_k_factors`:
    ``(d * scale) * q - dmin * min`` as one fused multiply-add (exact: see `_k_pass`)."""
    vector = ir.VectorType(_FLOAT, count)
    ints = ir.VectorType(_I32, count)
    sub = builder.udiv(group, _intp(4))
    column = builder.mul(builder.urem(group, _intp(4)), _intp(8))
    chunk, nibble = builder.udiv(sub, _intp(2)), builder.urem(sub, _intp(2))
    qs = 16 if name == "Q4_K" else 48
    q = _bytes(builder, block, builder.add(_intp(qs), builder.add(builder.mul(chunk, _intp(32)), column)), count,
               builder.mul(nibble, _intp(4)), 0x0F)
    if name == "Q5_K":
        high = _bytes(builder, block, builder.add(_intp(16), column), count, sub, 0x01)
        q = builder.or_(q, builder.shl(high, ir.Constant(ints, [4] * count)))
    return _scale_and_shift(builder, factors[0], builder.uitofp(q, vector), factors[1])


def _block_at(context, builder: ir.IRBuilder, array_type, array: ir.Value, row: ir.Value,
              column: ir.Value) -> tuple[Format, ir.Value, ir.Value]:
    """(format, i8 pointer to the block holding weight ``column`` of row ``row``, the group
    of 8 that weight starts within it): intp values in, for a stored block tensor."""
    format = numba_format(array_type.dtype)
    stored = context.make_array(array_type)(context, builder, value=array)
    base = builder.bitcast(stored.data, _I8.as_pointer())
    row_stride = builder.extract_value(stored.strides, 0)
    block_size = _intp(format.block)
    block_index = builder.udiv(column, block_size)
    offset = builder.add(builder.mul(row, row_stride),
                         builder.mul(block_index, _intp(format.dtype.itemsize)))
    group = builder.udiv(builder.urem(column, block_size), _intp(8))
    return format, builder.gep(base, [offset], source_etype=_I8), group


def load_groups(context, builder: ir.IRBuilder, array_type, array: ir.Value, row: ir.Value, column: ir.Value,
                groups: int, count: int) -> list[ir.Value]:
    """``groups`` consecutive groups of ``count`` weights from weight ``column`` (a multiple of
    ``groups * count`` = the block size for 32-weight formats) of row ``row``, de-quantised:
    one block's scales read once, its group offsets constants the compiler folds."""
    format, block, first = _block_at(context, builder, array_type, array, row, column)
    if groups * count != 32:  # pragma: no cover - `lanes.load_block` reads 4 groups of 8
        raise AssertionError("a pass reads one 32-weight block (or K-quant sub-block)")
    if format.block == 256:
        return _k_pass(builder, format.name, block, first, groups, count)
    return [dequantize_group(builder, format, block, builder.add(first, _intp(g)), count)
            for g in range(groups)]
