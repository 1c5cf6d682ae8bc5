"""Explicit-order float32 lanes: every sum of the kernels, written out so no compiler or CPU
can change a bit.

Why: with ``fastmath`` reassociation LLVM picks each loop's summation order (vector width,
interleave, horizontal sum), so two register blocks computing the same dot product agreed
only where it happened to vectorise both alike: it did on a Zen 3 (AVX2) core and did not on
a Zen 4 (AVX-512) one. Here the order is part of the code:

- A dot product of length K runs `LANES` partial sums: lane ``l`` sums the products of the
  elements ``k = l, l + LANES, l + 2 LANES, ...`` in increasing ``k``, each step one fused
  multiply-add (``llvm.fma``: rounded once, on every CPU; never a separate multiply and add).
  Elements past the last whole group of `LANES` go to their lanes one by one (`fma_tail`),
  the lanes past K are left as they are.
- The lanes are then combined by one fixed tree (`total`): ``(l0 + l4) + (l2 + l6)`` and
  ``(l1 + l5) + (l3 + l7)``, then their sum.
- A `Lanes` value is an LLVM vector ``<LANES x float>``: each operation is one IEEE
  operation per lane (no flag lets LLVM reorder them), however the target splits or widens
  the vector (two 128-bit halves, one 256-bit register, half a 512-bit one).

So a dot product's bits depend on its inputs alone: not on the register block computing it,
the rows beside it, the thread count, or the instruction set. 8 lanes fill one AVX2 register
(16 vector registers: a 3x4 block's 12 accumulators fit) and half an AVX-512 one (Zen 4 runs
512-bit operations as two 256-bit halves, so 16 lanes would buy no arithmetic there and
would spill every AVX2 block): the trade is written down in docs/kernels.md.

Stored 16-bit weights load widened (`load` on ``uint16`` bfloat16 bits or ``int16`` float16
bits, see `widen`): every 16-bit float is exactly a float32.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from recap.target.kernels.widen import widen

LANES = 8
"""Partial sums per dot product. Part of the arithmetic's definition: changing it changes
every logit's bits (and `KERNELS_REVISION` must follow)."""

_FLOAT = ir.FloatType()
_VECTOR = ir.VectorType(_FLOAT, LANES)
_I32 = ir.IntType(32)


class Lanes(types.Type):
    """numba's type of `LANES` float32 partial sums held in one LLVM vector value."""

    def __init__(self):
        super().__init__(name=f"Lanes{LANES}xf32")


lanes = Lanes()


@register_model(Lanes)
class _LanesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VECTOR)


def _fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """``a * b + c`` rounded once (``llvm.fma``), vector or scalar float32."""
    name = f"llvm.fma.v{a.type.count}f32" if isinstance(a.type, ir.VectorType) else "llvm.fma.f32"
    function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3), name)
    return builder.call(function, [a, b, c])


@intrinsic
def zeros(typingctx):  # pragma: no cover - compiled
    """`LANES` partial sums of +0."""
    def codegen(context, builder, signature, args):
        return ir.Constant(_VECTOR, [0.0] * LANES)
    return lanes(), codegen


_WIDTHS = {types.float32: None, types.uint16: "bfloat16", types.int16: "float16"}


@intrinsic
def load(typingctx, array, start):  # pragma: no cover - compiled
    """``array[start:start + LANES]`` widened to float32: ``array`` a C-contiguous 1-D array
    of float32, or 16-bit float bits (`widen.storage`); the caller keeps it in bounds."""
    if not (isinstance(array, types.Array) and array.ndim == 1 and array.layout == "C"
            and array.dtype in _WIDTHS and isinstance(start, types.Integer)):
        return None
    kind = _WIDTHS[array.dtype]

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, value=args[0]).data
        index = context.cast(builder, args[1], signature.args[1], types.intp)
        element = context.get_data_type(signature.args[0].dtype)
        pointer = builder.gep(data, [index], inbounds=True, source_etype=element)
        raw = builder.load(pointer, align=element.width // 8 if kind else 4,
                           typ=ir.VectorType(element, LANES))
        if kind is None:
            return raw
        if kind == "float16":
            return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), LANES)), _VECTOR)
        wide = builder.zext(raw, ir.VectorType(_I32, LANES))
        shifted = builder.shl(wide, ir.Constant(ir.VectorType(_I32, LANES), [16] * LANES))
        return builder.bitcast(shifted, _VECTOR)

    return lanes(array, start), codegen


@intrinsic
def fma(typingctx, a, b, c):  # pragma: no cover - compiled
    """``a * b + c`` per lane, rounded once."""
    if not (a == lanes and b == lanes and c == lanes):
        return None

    def codegen(context, builder, signature, args):
        return _fma(builder, *args)

    return lanes(lanes, lanes, lanes), codegen


@intrinsic
def add(typingctx, a, b):  # pragma: no cover - compiled
    """``a + b`` per lane."""
    if not (a == lanes and b == lanes):
        return None

    def codegen(context, builder, signature, args):
        return builder.fadd(*args)

    return lanes(lanes, lanes), codegen


@intrinsic
def fma1(typingctx, a, b, c):  # pragma: no cover - compiled
    """``a * b + c`` on float32 scalars, rounded once (the tail's step, as a lane's)."""
    if not (a == types.float32 and b == types.float32 and c == types.float32):
        return None

    def codegen(context, builder, signature, args):
        return _fma(builder, *args)

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def lane(typingctx, v, i):  # pragma: no cover - compiled
    """Partial sum ``i`` of ``v``."""
    if not (v == lanes and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        return builder.extract_element(args[0], context.cast(builder, args[1], signature.args[1], types.int32))

    return types.float32(v, i), codegen


@intrinsic
def with_lane(typingctx, v, i, value):  # pragma: no cover - compiled
    """``v`` with partial sum ``i`` replaced by ``value``."""
    if not (v == lanes and isinstance(i, types.Integer) and value == types.float32):
        return None

    def codegen(context, builder, signature, args):
        index = context.cast(builder, args[1], signature.args[1], types.int32)
        return builder.insert_element(args[0], args[2], index)

    return lanes(v, i, value), codegen


def _halves(builder: ir.IRBuilder, v: ir.Value, width: int) -> ir.Value:
    """Lanes i and i + width / 2 added, for i < width / 2 (a vector of width / 2)."""
    half = width // 2
    low = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half))))
    high = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half, width))))
    return builder.fadd(low, high)


@intrinsic
def total(typingctx, v):  # pragma: no cover - compiled
    """The sum of the partial sums by the fixed tree: halves added lane by lane until one
    is left (for 8 lanes: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)))."""
    if v != lanes:
        return None

    def codegen(context, builder, signature, args):
        value, width = args[0], LANES
        while width > 1:
            value, width = _halves(builder, value, width), width // 2
        return builder.extract_element(value, ir.Constant(_I32, 0))

    return types.float32(v), codegen


@intrinsic
def keep_rolled(typingctx):  # pragma: no cover - compiled
    """A no-op that keeps the loop holding it rolled: LLVM does not runtime-unroll a loop with
    a convergent operation. Called first in every register block's loop over K: unrolled 4x,
    the 3x4 block's 4-row step ran 10% slower than one group of lanes per pass (AVX2 code,
    docs/kernels.md); the order of the sums is the same either way."""
    def codegen(context, builder, signature, args):
        call = builder.asm(ir.FunctionType(ir.VoidType(), []), "", "", [], side_effect=True)
        call.attributes.add("convergent")
        return context.get_dummy_value()
    return types.none(), codegen


@njit
def fma_tail(acc, x, w, start):  # pragma: no cover - compiled
    # not inlined by numba: inlining every block's tails tripled the kernels' compile time,
    # and a tail runs once per dot product, only where K is not a multiple of LANES
    """``acc`` after the elements ``start ..`` of ``x`` and ``w`` (fewer than `LANES`, each
    into its own lane ``k - start``, as a whole group would put them): a dot product's tail."""
    for i in range(x.shape[0] - start):
        acc = with_lane(acc, i, fma1(x[start + i], widen(w[start + i]), lane(acc, i)))
    return acc


@njit(inline="always")
def whole(length):  # pragma: no cover - compiled
    """Elements of a ``length``-long dot product that whole groups of `LANES` cover."""
    return length - length % LANES


@njit(inline="always")
def finish(acc, bias, n):  # pragma: no cover - compiled
    """A dot product's result: `total` of its lanes, plus ``bias[n]`` when there is a bias
    (``bias``: (N,) float32 or empty)."""
    s = total(acc)
    if bias.shape[0]:
        s += bias[n]
    return s


@njit(cache=True)
def dot(a, b):  # pragma: no cover - compiled
    """``a . b`` for float32 vectors of one length, in the order the module's docstring
    defines (``b`` may hold stored 16-bit weights)."""
    acc = zeros()
    length = a.shape[0]
    full = whole(length)
    for k in range(0, full, LANES):
        acc = fma(load(a, k), load(b, k), acc)
    if full < length:
        acc = fma_tail(acc, a, b, full)
    return total(acc)


def reference_dot(a: np.ndarray, b: np.ndarray) -> np.float32:
    """`dot`'s order in plain Python, one exact operation at a time (`fractions`, each result
    rounded once to float32): what the tests hold every register block to."""
    partial = [np.float32(0)] * LANES
    for k in range(len(a)):
        exact = Fraction(float(a[k])) * Fraction(float(b[k])) + Fraction(float(partial[k % LANES]))
        partial[k % LANES] = _nearest_float32(exact)
    values, width = partial, LANES
    while width > 1:
        half = width // 2
        values, width = [np.float32(values[i] + values[i + half]) for i in range(half)], half
    return values[0]


def _nearest_float32(exact: Fraction) -> np.float32:
    """``exact`` rounded to the nearest float32, ties to even (finite values)."""
    guess = np.float32(float(exact))
    candidates = (np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf)))
    return min(candidates, key=lambda f: (abs(Fraction(float(f)) - exact), int(f.view(np.int32)) & 1))
