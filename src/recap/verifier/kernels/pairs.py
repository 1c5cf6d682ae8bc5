"""Two rows' `lanes` partial sums in one vector: the operands of the paired register blocks.

Why: a core with two full-width 512-bit multiply-add units (Intel's AVX-512 server cores)
does twice the arithmetic a cycle on 16 floats that it does on `LANES` (8). The partial sums
of a dot product are 8 by definition (`lanes`: part of every logit's bits), so the wider
vector holds the 8 partial sums of *two* dot products side by side: lanes 0-7 are one's,
lanes 8-15 the other's, each half the very `Lanes` value a `LANES`-wide block would hold,
operation for operation (an LLVM vector operation is one IEEE operation per lane). Nothing
is summed across the halves until `low` / `high` split them back into `Lanes`, so the bits
are the unpaired blocks' by construction; `linear.blocks_agree` and
`linear.stored_blocks_agree` check it once per width and weight format anyway.

Two ways to pair:

- **Two token rows, one weight row** (`register_blocks._block4x8`, steps of 8 rows and more):
  the pair reads its two rows from a pair-interleaved copy of the step's x (`interleave`: for
  each group of `LANES` elements, row j's then row j + 1's), so one aligned-size load fills
  it; each weight row's `LANES` weights are loaded once and repeated into both halves
  (`load_twice`).
- **Two weight rows, one token row** (`quantized_linear`'s 8x1, 8x2 and 8x4 blocks, steps of
  1-4 rows on GGUF blocks): `load_blocks` de-quantises the same 32 weights of two weight
  rows side by side, so a de-quantising operation widens 16 weights; the token row's x is
  repeated into both halves (`load_twice`).

On a core that runs 512-bit operations as two 256-bit halves (Zen 4) the blocks do the same
arithmetic as the unpaired ones with fewer instructions; on 16-register CPUs (AVX2) they are
not used (`linear.WEIGHT_ROWS` 3).
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from recap.verifier.kernels import lanes, llvm_ops, quantized
from recap.verifier.kernels.lanes import LANES

WIDTH = 2 * LANES
"""Floats in a `Pair`: two token rows' partial sums."""

_FLOAT = ir.FloatType()
_PAIR = ir.VectorType(_FLOAT, WIDTH)
_I32 = ir.IntType(32)


class Pair(types.Type):
    """numba's type of two token rows' `LANES` partial sums held in one LLVM vector."""

    def __init__(self):
        super().__init__(name=f"Pair{WIDTH}xf32")


pair_type = Pair()


@register_model(Pair)
class _PairModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _PAIR)


@intrinsic
def zeros(typingctx):  # pragma: no cover - compiled
    """Two rows' `LANES` partial sums of +0."""
    def codegen(context, builder, signature, args):
        return ir.Constant(_PAIR, [0.0] * WIDTH)
    return pair_type(), codegen


@intrinsic
def load(typingctx, pairs, pair, start):  # pragma: no cover - compiled
    """Elements ``start .. start + LANES - 1`` of both rows of pair ``pair`` of an `interleave`d
    x (``pairs[pair, 2 start : 2 start + WIDTH]``); the caller keeps it in bounds."""
    if not (isinstance(pairs, types.Array) and pairs.ndim == 2 and pairs.layout == "C"
            and pairs.dtype == types.float32 and isinstance(pair, types.Integer) and isinstance(start, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        array_type, pair_index_type, start_type = signature.args
        column = builder.mul(context.cast(builder, args[2], start_type, types.intp), ir.Constant(cgutils.intp_t, 2))
        index = lanes._flat_index(context, builder, array_type, args[0], args[1], pair_index_type, column, types.intp)
        return lanes._load(context, builder, array_type, args[0], index, WIDTH, None)

    return pair_type(pairs, pair, start), codegen


@intrinsic
def load_twice(typingctx, array, row, start):  # pragma: no cover - compiled
    """``array[row, start:start + LANES]`` as `lanes.load_row` reads it (16-bit floats
    widened), in both halves."""
    if not (isinstance(array, types.Array) and array.ndim == 2 and array.layout == "C"
            and array.dtype in lanes._WIDTHS and isinstance(row, types.Integer) and isinstance(start, types.Integer)):
        return None
    kind = lanes._WIDTHS[array.dtype]

    def codegen(context, builder, signature, args):
        array_type, row_type, start_type = signature.args
        index = lanes._flat_index(context, builder, array_type, args[0], args[1], row_type, args[2], start_type)
        value = lanes._load(context, builder, array_type, args[0], index, LANES, kind)
        return builder.shuffle_vector(value, value, ir.Constant(ir.VectorType(_I32, WIDTH), list(range(LANES)) * 2))

    return pair_type(array, row, start), codegen


@intrinsic
def fma(typingctx, a, b, c):  # pragma: no cover - compiled
    """``a * b + c`` per lane, rounded once (each half: `lanes.fma`)."""
    if not (a == pair_type and b == pair_type and c == pair_type):
        return None

    def codegen(context, builder, signature, args):
        return llvm_ops.fma(builder, *args)

    return pair_type(pair_type, pair_type, pair_type), codegen


def _half(first: int):
    @intrinsic
    def half(typingctx, pair):  # pragma: no cover - compiled
        if pair != pair_type:
            return None

        def codegen(context, builder, signature, args):
            picks = ir.Constant(ir.VectorType(_I32, LANES), list(range(first, first + LANES)))
            return builder.shuffle_vector(args[0], args[0], picks)

        return lanes.lanes_type(pair), codegen
    return half


low = _half(0)
"""The first row's `Lanes` of a pair."""
high = _half(LANES)
"""The second row's `Lanes` of a pair."""


@njit(inline="always")
def interleave(x, rows, pairs):  # pragma: no cover - compiled
    """``pairs[j]`` = rows 2j and 2j + 1 of x (f32, (>= rows, K)) interleaved by groups of
    `LANES` (row 2j's group, then row 2j + 1's), for 2j < ``rows`` (even); elements past the
    last whole group are not copied (the blocks read them from x: `lanes.fma_tail_rows`)."""
    full = lanes.whole(x.shape[1])
    for j in range(rows // 2):
        for k in range(0, full, LANES):
            for i in range(LANES):
                pairs[j, 2 * k + i] = x[2 * j, k + i]
                pairs[j, 2 * k + LANES + i] = x[2 * j + 1, k + i]


@intrinsic
def load_blocks(typingctx, array, first_row, second_row, start):  # pragma: no cover - compiled
    """`lanes.load_block` of two weight rows side by side: weights ``start .. start + 31`` of
    rows ``first_row`` (low halves) and ``second_row`` (high halves) of a stored GGUF block
    tensor, de-quantised by the very operations `load_block` does for each row alone
    (`quantized.load_groups`, one lane per weight): a tuple of `lanes.GROUPS` pairs. Twice
    the weights per vector operation where 512-bit registers are whole."""
    if not (isinstance(array, types.Array) and array.ndim == 2 and array.layout == "C"
            and quantized.numba_format(array.dtype) is not None and isinstance(first_row, types.Integer)
            and isinstance(second_row, types.Integer) and isinstance(start, types.Integer)):
        return None
    result = types.UniTuple(pair_type, lanes.GROUPS)

    def codegen(context, builder, signature, args):
        array_type, first_type, second_type, start_type = signature.args
        rows = [context.cast(builder, args[1], first_type, types.intp),
                context.cast(builder, args[2], second_type, types.intp)]
        values = quantized.load_groups(context, builder, array_type, args[0], rows,
                                       context.cast(builder, args[3], start_type, types.intp), lanes.GROUPS, LANES)
        return context.make_tuple(builder, signature.return_type, values)

    return result(array, first_row, second_row, start), codegen
