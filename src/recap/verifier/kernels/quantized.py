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


Blocks = tuple[ir.Value, ...]
"""i8 pointers to the blocks one vector reads, in lane order: each block (one weight row's, at
the same column) fills ``count`` lanes. One block for a `Lanes` vector, two for a `pairs.Pair`
(two weight rows side by side: every lane still holds its own row's weight)."""


def _concat(builder: ir.IRBuilder, parts: list[ir.Value]) -> ir.Value:
    """Vectors of one type side by side (one part: itself; two: a shuffle)."""
    if len(parts) == 1:
        return parts[0]
    first, second = parts  # a Lanes vector or a pair: at most two blocks
    width = 2 * first.type.count
    return builder.shuffle_vector(first, second, ir.Constant(ir.VectorType(_I32, width), list(range(width))))


def _vector_at(builder: ir.IRBuilder, blocks: Blocks, offset: ir.Value | int, element: ir.Type,
               count: int) -> ir.Value:
    """``count`` values of type ``element`` at ``offset`` bytes into each block, side by side."""
    return _concat(builder, [_at(builder, block, offset, ir.VectorType(element, count)) for block in blocks])


def _spread(builder: ir.IRBuilder, values: list[ir.Value], count: int) -> ir.Value:
    """Each block's scalar (``values[i]``, say its scale) in that block's ``count`` lanes."""
    return _concat(builder, [llvm_ops.broadcast(builder, value, count) for value in values])


def _constant(blocks: Blocks, values: list[int]) -> ir.Constant:
    """An int32 vector holding ``values`` (one block's lanes) for every block."""
    return ir.Constant(ir.VectorType(_I32, len(blocks) * len(values)), values * len(blocks))


def _bytes(builder: ir.IRBuilder, blocks: Blocks, offset: ir.Value, count: int, shift: ir.Value,
           mask: int) -> ir.Value:
    """``count`` bytes from ``offset`` in each block as int32, each shifted right by ``shift``
    (an intp value, the same for every block) and masked with ``mask``."""
    width = len(blocks) * count
    raw = builder.zext(_vector_at(builder, blocks, offset, _I8, count), ir.VectorType(_I32, width))
    shifted = builder.lshr(raw, llvm_ops.broadcast(builder, builder.trunc(shift, _I32), width))
    return builder.and_(shifted, _constant(blocks, [mask] * count))


def _nibbles(builder: ir.IRBuilder, blocks: Blocks, start: int, group: ir.Value, count: int) -> ir.Value:
    """The 4-bit values of weights 8 group .. 8 group + 7 of 32-weight blocks whose 16 bytes
    start at ``start``: weights 0-15 are the bytes' low nibbles, 16-31 their high ones (as
    ``gguf`` orders them); ``count`` int32 per block."""
    # groups 0 and 2 read bytes 0-7, groups 1 and 3 bytes 8-15; groups 2 and 3 the high nibbles
    bytes_from = builder.add(_intp(start), builder.mul(builder.and_(group, _intp(1)), _intp(8)))
    return _bytes(builder, blocks, bytes_from, count, builder.mul(builder.lshr(group, _intp(1)), _intp(4)), 0x0F)


def _fifth_bits(builder: ir.IRBuilder, blocks: Blocks, start: int, group: ir.Value, count: int) -> ir.Value:
    """Bit 4 of weights 8 group .. 8 group + 7 (bit j of a block's little-endian uint32 at
    ``start`` is its weight j's), as int32 values 0 or 16."""
    shift = builder.trunc(builder.mul(group, _intp(8)), _I32)
    bytes_ = _spread(builder, [builder.lshr(_at(builder, block, start, _I32), shift) for block in blocks], count)
    width = len(blocks) * count
    set_ = builder.icmp_unsigned("!=", builder.and_(bytes_, _constant(blocks, [1 << j for j in range(count)])),
                                 _constant(blocks, [0] * count))
    return builder.shl(builder.zext(set_, ir.VectorType(_I32, width)), _constant(blocks, [4] * count))


def _scale_and_shift(builder: ir.IRBuilder, d: ir.Value, q: ir.Value, m: ir.Value) -> ir.Value:
    """``gguf``'s ``(d * q) + m``, as one fused multiply-add: the same bits, because ``d * q``
    is exact in float32 (d a float16, 11 significant bits; |q| <= 32, 6 bits: at most 17
    significant bits, and no float16 is small enough to leave float32's normal range), so
    rounding it first changes nothing (``tests/test_quantized.py`` checks every float16)."""
    return llvm_ops.fma(builder, d, q, m)


def dequantize_group(builder: ir.IRBuilder, format: Format, blocks: Blocks, group: ir.Value,
                     count: int) -> ir.Value:
    """Weights 8 group .. 8 group + count - 1 of each block in ``blocks`` (i8 pointers) as one
    float32 vector, by ``gguf``'s operations in ``gguf``'s order (see the module docstring)."""
    vector = ir.VectorType(_FLOAT, len(blocks) * count)

    def scale(offset: int) -> ir.Value:  # each block's float16 at ``offset``, in its lanes
        return _spread(builder, [_half(builder, block, offset) for block in blocks], count)

    if format.name == "Q8_0":  # x * d
        offset = builder.add(_intp(2), builder.mul(group, _intp(8)))
        values = builder.sitofp(_vector_at(builder, blocks, offset, _I8, count), vector)
        return builder.fmul(values, scale(0))
    if format.name == "Q4_0":  # d * (q - 8)
        q = builder.sub(_nibbles(builder, blocks, 2, group, count), _constant(blocks, [8] * count))
        return builder.fmul(scale(0), builder.sitofp(q, vector))
    if format.name == "Q4_1":  # (d * q) + m
        q = builder.uitofp(_nibbles(builder, blocks, 4, group, count), vector)
        return _scale_and_shift(builder, scale(0), q, scale(2))
    if format.name == "Q5_0":  # d * ((q | bit4) - 16)
        q = builder.or_(_nibbles(builder, blocks, 6, group, count), _fifth_bits(builder, blocks, 2, group, count))
        q = builder.sub(q, _constant(blocks, [16] * count))
        return builder.fmul(scale(0), builder.sitofp(q, vector))
    if format.name == "Q5_1":  # (d * (q | bit4)) + m
        q = builder.or_(_nibbles(builder, blocks, 8, group, count), _fifth_bits(builder, blocks, 4, group, count))
        return _scale_and_shift(builder, scale(0), builder.uitofp(q, vector), scale(2))
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


def _k_pass(builder: ir.IRBuilder, name: str, blocks: Blocks, first: ir.Value, groups: int,
            count: int) -> list[ir.Value]:
    """Groups ``first`` .. ``first + groups - 1`` (8 weights each; ``first`` a multiple of 4,
    so one 32-weight sub-block) of 256-weight K-quant super-blocks, by ``gguf``'s arithmetic.
    Q4_K / Q5_K: ``(d * scale) * q - dmin * min`` per 32-weight sub-block (every product exact
    in float32: d * scale has at most 17 significant bits, times a 5-bit q at most 22), so one
    fused multiply-add; Q6_K: ``(d * scale) * q`` per 16-weight sub-block, a plain multiply
    (that product can round). The packed scales are unpacked once for the pass, not once a
    group: LLVM cannot see that ``first`` is a multiple of 4, so it would not share them."""
    if name == "Q6_K":  # two 16-weight sub-blocks
        sub = builder.udiv(first, _intp(2))
        factors = [_q6_factor(builder, blocks, builder.add(sub, _intp(i)), count) for i in range(2)]
        return [_q6_values(builder, blocks, builder.add(first, _intp(g)), count, factors[g // 2])
                for g in range(groups)]
    factors = _k_factors(builder, blocks, builder.udiv(first, _intp(4)), count)
    return [_k_values(builder, name, blocks, builder.add(first, _intp(g)), count, factors) for g in range(groups)]


def _q6_factor(builder: ir.IRBuilder, blocks: Blocks, sub: ir.Value, count: int) -> ir.Value:
    """Q6_K: each block's 16-weight sub-block ``sub``'s ``d * scale``, in its ``count`` lanes."""
    def factor(block: ir.Value) -> ir.Value:
        scale = builder.sitofp(_at(builder, block, builder.add(_intp(192), sub), _I8), _FLOAT)
        return builder.fmul(_half(builder, block, 208), scale)
    return _spread(builder, [factor(block) for block in blocks], count)


def _q6_values(builder: ir.IRBuilder, blocks: Blocks, group: ir.Value, count: int, factor: ir.Value) -> ir.Value:
    """Q6_K weights 8 group .. 8 group + 7 given their sub-block's `_q6_factor`: ``(d * scale)
    * q``, a plain multiply (see `_k_pass`)."""
    vector = ir.VectorType(_FLOAT, len(blocks) * count)
    first = builder.mul(group, _intp(8))  # the group's first weight in the super-block
    half, within = builder.udiv(first, _intp(128)), builder.urem(first, _intp(128))
    nibble, byte = builder.udiv(within, _intp(64)), builder.urem(within, _intp(64))
    low = _bytes(builder, blocks, builder.add(builder.mul(half, _intp(64)), byte), count,
                 builder.mul(nibble, _intp(4)), 0x0F)
    pair, column = builder.udiv(within, _intp(32)), builder.urem(within, _intp(32))
    high = _bytes(builder, blocks, builder.add(_intp(128), builder.add(builder.mul(half, _intp(32)), column)),
                  count, builder.mul(pair, _intp(2)), 0x03)
    q = builder.sub(builder.or_(low, builder.shl(high, _constant(blocks, [4] * count))),
                    _constant(blocks, [32] * count))
    return builder.fmul(factor, builder.sitofp(q, vector))


def _k_factors(builder: ir.IRBuilder, blocks: Blocks, sub: ir.Value, count: int) -> tuple[ir.Value, ir.Value]:
    """Q4_K / Q5_K: each block's sub-block ``sub``'s ``d * scale`` and ``-(dmin * min)``, in its
    ``count`` lanes (the same for the sub-block's 4 groups of 8)."""
    scales, minima = [], []
    for block in blocks:
        scale, minimum = _k_scale_min(builder, block, sub)
        scales.append(builder.fmul(_half(builder, block, 0), builder.uitofp(scale, _FLOAT)))
        minima.append(builder.fneg(builder.fmul(_half(builder, block, 2), builder.uitofp(minimum, _FLOAT))))
    return _spread(builder, scales, count), _spread(builder, minima, count)


def _k_values(builder: ir.IRBuilder, name: str, blocks: Blocks, group: ir.Value, count: int,
              factors: tuple[ir.Value, ir.Value]) -> ir.Value:
    """Q4_K / Q5_K weights 8 group .. 8 group + 7 given their sub-block's `_k_factors`:
    ``(d * scale) * q - dmin * min`` as one fused multiply-add (exact: see `_k_pass`)."""
    vector = ir.VectorType(_FLOAT, len(blocks) * count)
    sub = builder.udiv(group, _intp(4))
    column = builder.mul(builder.urem(group, _intp(4)), _intp(8))
    chunk, nibble = builder.udiv(sub, _intp(2)), builder.urem(sub, _intp(2))
    qs = 16 if name == "Q4_K" else 48
    q = _bytes(builder, blocks, builder.add(_intp(qs), builder.add(builder.mul(chunk, _intp(32)), column)), count,
               builder.mul(nibble, _intp(4)), 0x0F)
    if name == "Q5_K":
        high = _bytes(builder, blocks, builder.add(_intp(16), column), count, sub, 0x01)
        q = builder.or_(q, builder.shl(high, _constant(blocks, [4] * count)))
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


def load_groups(context, builder: ir.IRBuilder, array_type, array: ir.Value, rows: list[ir.Value],
                column: ir.Value, groups: int, count: int) -> list[ir.Value]:
    """``groups`` consecutive groups of ``count`` weights from weight ``column`` (a multiple of
    ``groups * count`` = the block size for 32-weight formats) of each of ``rows`` (1 or 2
    weight rows, side by side in each vector: ``count`` lanes each), de-quantised: each block's
    scales read once, its group offsets constants the compiler folds."""
    found = [_block_at(context, builder, array_type, array, row, column) for row in rows]
    format, first = found[0][0], found[0][2]  # the same column: the same group in every row
    blocks = tuple(block for _, block, _ in found)
    if groups * count != 32:  # pragma: no cover - `lanes.load_block` reads 4 groups of 8
        raise AssertionError("a pass reads one 32-weight block (or K-quant sub-block)")
    if format.block == 256:
        return _k_pass(builder, format.name, blocks, first, groups, count)
    return [dequantize_group(builder, format, blocks, builder.add(first, _intp(g)), count)
            for g in range(groups)]
