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

A register block reads rows by index (`load_row`, `fma_tail_rows`) and writes its results
with `store`, all intrinsics: arrays pass into intrinsics without numba's reference counting,
whose atomic updates (for every row view a block made, and around inlined helpers) cost a
block more than its arithmetic at short K.

So a dot product's bits depend on its inputs alone: not on the register block computing it,
the rows beside it, the thread count, or the instruction set. 8 lanes fill one AVX2 register
(16 vector registers: a 3x4 block's 12 accumulators fit) and half an AVX-512 one (Zen 4 runs
512-bit operations as two 256-bit halves, so 16 lanes would buy no arithmetic there and
would spill every AVX2 block): the trade is written down in docs/kernels.md.

Stored 16-bit weights load widened (`load` on ``uint16`` bfloat16 bits or ``int16`` float16
bits, see `widen.storage`): every 16-bit float is exactly a float32. Stored GGUF blocks load
de-quantised (`load_row` on a `quantized` block tensor), by the very float32 operations the
float weights were made with.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from recap.verifier.kernels import llvm_ops, quantized, widen

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


lanes_type = Lanes()
"""The numba type of a `Lanes` value (the instance intrinsics are typed with)."""


@register_model(Lanes)
class _LanesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VECTOR)


@intrinsic
def zeros(typingctx):  # pragma: no cover - compiled
    """`LANES` partial sums of +0."""
    def codegen(context, builder, signature, args):
        return ir.Constant(_VECTOR, [0.0] * LANES)
    return lanes_type(), codegen


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
        index = context.cast(builder, args[1], signature.args[1], types.intp)
        return _load(context, builder, signature.args[0], args[0], index, LANES, kind)

    return lanes_type(array, start), codegen


@intrinsic
def load_row(typingctx, array, row, start):  # pragma: no cover - compiled
    """``array[row, start:start + LANES]`` widened to float32: ``array`` a C-contiguous 2-D
    array (as `load` reads it). A row index instead of a row view: a view is reference
    counted (atomic updates each time a block makes one), an index is not. (Stored GGUF
    blocks are read a whole block at a time: `load_block`.)"""
    if not (isinstance(array, types.Array) and array.ndim == 2 and array.layout == "C"
            and array.dtype in _WIDTHS and isinstance(row, types.Integer) and isinstance(start, types.Integer)):
        return None
    kind = _WIDTHS[array.dtype]

    def codegen(context, builder, signature, args):
        index = _flat_index(context, builder, signature.args[0], args[0], args[1], signature.args[1],
                            args[2], signature.args[2])
        return _load(context, builder, signature.args[0], args[0], index, LANES, kind)

    return lanes_type(array, row, start), codegen


GROUPS = 4
"""Groups of `LANES` `load_block` returns: 32 weights, one block of the 32-weight GGUF formats."""


@intrinsic
def load_block(typingctx, array, row, start):  # pragma: no cover - compiled
    """Weights ``start .. start + GROUPS * LANES - 1`` of row ``row`` of a stored GGUF block
    tensor (`quantized`; ``start`` a multiple of 32), de-quantised: a tuple of `GROUPS`
    `Lanes`. The register blocks over stored weights read a whole block at a time, so its
    scales are read once and its nibble offsets are constants."""
    if not (isinstance(array, types.Array) and array.ndim == 2 and array.layout == "C"
            and quantized.numba_format(array.dtype) is not None
            and isinstance(row, types.Integer) and isinstance(start, types.Integer)):
        return None
    result = types.UniTuple(lanes_type, GROUPS)

    def codegen(context, builder, signature, args):
        array_type, row_type, start_type = signature.args
        values = quantized.load_groups(context, builder, array_type, args[0],
                                       [context.cast(builder, args[1], row_type, types.intp)],
                                       context.cast(builder, args[2], start_type, types.intp), GROUPS, LANES)
        return context.make_tuple(builder, signature.return_type, values)

    return result(array, row, start), codegen


@intrinsic
def put_row(typingctx, array, row, start, value):  # pragma: no cover - compiled
    """``array[row, start:start + LANES] = value``: ``array`` a C-contiguous 2-D float32 array
    (a scratch panel of de-quantised weights); the caller keeps it in bounds."""
    if not (isinstance(array, types.Array) and array.ndim == 2 and array.layout == "C"
            and array.dtype == types.float32 and isinstance(row, types.Integer)
            and isinstance(start, types.Integer) and value == lanes_type):
        return None

    def codegen(context, builder, signature, args):
        array_type, row_type, start_type, _ = signature.args
        index = _flat_index(context, builder, array_type, args[0], args[1], row_type, args[2], start_type)
        data = context.make_array(array_type)(context, builder, value=args[0]).data
        pointer = builder.gep(data, [index], inbounds=True, source_etype=_FLOAT)
        builder.store(args[3], builder.bitcast(pointer, _VECTOR.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(array, row, start, value), codegen


def _flat_index(context, builder: ir.IRBuilder, array_type, array: ir.Value, row: ir.Value, row_type,
                column: ir.Value, column_type) -> ir.Value:
    """``row * columns + column`` of a C-contiguous 2-D array."""
    columns = builder.extract_value(context.make_array(array_type)(context, builder, value=array).shape, 1)
    row = context.cast(builder, row, row_type, types.intp)
    column = context.cast(builder, column, column_type, types.intp)
    return builder.add(builder.mul(row, columns), column)


def _load(context, builder: ir.IRBuilder, array_type, array: ir.Value, index: ir.Value, count: int,
          kind: str | None) -> ir.Value:
    """``count`` elements of a 1-D array from ``index`` on (a vector, or a scalar for
    ``count`` 1), widened to float32 (``kind``: None, "bfloat16" or "float16")."""
    data = context.make_array(array_type)(context, builder, value=array).data
    element = context.get_data_type(array_type.dtype)
    pointer = builder.gep(data, [index], inbounds=True, source_etype=element)
    stored = element if count == 1 else ir.VectorType(element, count)
    raw = builder.load(pointer, align=element.width // 8 if kind else 4, typ=stored)
    if kind is None:
        return raw
    wide_float = _FLOAT if count == 1 else ir.VectorType(_FLOAT, count)
    if kind == "float16":
        return widen.half_to_float(builder, raw)
    wide_int = _I32 if count == 1 else ir.VectorType(_I32, count)
    sixteen = ir.Constant(wide_int, 16 if count == 1 else [16] * count)
    return builder.bitcast(builder.shl(builder.zext(raw, wide_int), sixteen), wide_float)


@intrinsic
def fma(typingctx, a, b, c):  # pragma: no cover - compiled
    """``a * b + c`` per lane, rounded once."""
    if not (a == lanes_type and b == lanes_type and c == lanes_type):
        return None

    def codegen(context, builder, signature, args):
        return llvm_ops.fma(builder, *args)

    return lanes_type(lanes_type, lanes_type, lanes_type), codegen


@intrinsic
def add(typingctx, a, b):  # pragma: no cover - compiled
    """``a + b`` per lane."""
    if not (a == lanes_type and b == lanes_type):
        return None

    def codegen(context, builder, signature, args):
        return builder.fadd(*args)

    return lanes_type(lanes_type, lanes_type), codegen


@intrinsic
def lane(typingctx, v, i):  # pragma: no cover - compiled
    """Partial sum ``i`` of ``v``."""
    if not (v == lanes_type and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        return builder.extract_element(args[0], context.cast(builder, args[1], signature.args[1], types.int32))

    return types.float32(v, i), codegen


@intrinsic
def with_lane(typingctx, v, i, value):  # pragma: no cover - compiled
    """``v`` with partial sum ``i`` replaced by ``value``."""
    if not (v == lanes_type and isinstance(i, types.Integer) and value == types.float32):
        return None

    def codegen(context, builder, signature, args):
        index = context.cast(builder, args[1], signature.args[1], types.int32)
        return builder.insert_element(args[0], args[2], index)

    return lanes_type(v, i, value), codegen


def _halves(builder: ir.IRBuilder, v: ir.Value, width: int) -> ir.Value:
    """Lanes i and i + width / 2 added, for i < width / 2 (a vector of width / 2)."""
    half = width // 2
    low = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half))))
    high = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half, width))))
    return builder.fadd(low, high)


def _sum_tree(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """`total`'s tree: halves added lane by lane until one is left."""
    value, width = v, LANES
    while width > 1:
        value, width = _halves(builder, value, width), width // 2
    return builder.extract_element(value, ir.Constant(_I32, 0))


@intrinsic
def total(typingctx, v):  # pragma: no cover - compiled
    """The sum of the partial sums by the fixed tree: halves added lane by lane until one
    is left (for 8 lanes: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)))."""
    if v != lanes_type:
        return None

    def codegen(context, builder, signature, args):
        return _sum_tree(builder, args[0])

    return types.float32(v), codegen


@intrinsic
def keep_rolled(typingctx):  # pragma: no cover - compiled
    """A no-op that keeps the loop holding it rolled: LLVM does not runtime-unroll a loop with
    a convergent operation. Called first in every register block's loop over K, so the loop
    keeps the shape the fastmath kernels had (one group of lanes a pass; unrolled 4x, steps
    measured slower, docs/kernels.md); the order of the sums is the same either way."""
    def codegen(context, builder, signature, args):
        call = builder.asm(ir.FunctionType(ir.VoidType(), []), "", "", [], side_effect=True)
        call.attributes.add("convergent")
        return context.get_dummy_value()
    return types.none(), codegen


@intrinsic
def fma_tail(typingctx, acc, x, w, start):  # pragma: no cover - compiled
    """``acc`` after the elements ``start ..`` of ``x`` and ``w`` (fewer than `LANES`, each
    into its own lane ``k - start``, as a whole group would put them): a dot product's tail.
    ``x``: float32, ``w``: as `load` reads it; both C-contiguous 1-D of one length. An
    intrinsic, like `store`: the arrays pass without reference counting."""
    if not (acc == lanes_type and isinstance(start, types.Integer)
            and all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in (x, w))
            and x.dtype == types.float32 and w.dtype in _WIDTHS):
        return None
    kind = _WIDTHS[w.dtype]

    def codegen(context, builder, signature, args):
        _, x_type, w_type, start_type = signature.args
        partial, xs, ws, first = args
        return _tail(context, builder, partial, context.cast(builder, first, start_type, types.intp),
                     (x_type, xs, lambda k: k), (w_type, ws, lambda k: k), kind)

    return lanes_type(acc, x, w, start), codegen


@intrinsic
def fma_tail_rows(typingctx, acc, x, x_row, w, w_row, start):  # pragma: no cover - compiled
    """`fma_tail` of rows ``x[x_row]`` and ``w[w_row]`` of C-contiguous 2-D arrays (row
    indices, not views: see `load_row`)."""
    if not (acc == lanes_type and isinstance(start, types.Integer)
            and isinstance(x_row, types.Integer) and isinstance(w_row, types.Integer)
            and all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in (x, w))
            and x.dtype == types.float32 and w.dtype in _WIDTHS):
        return None
    kind = _WIDTHS[w.dtype]

    def codegen(context, builder, signature, args):
        _, x_type, x_row_type, w_type, w_row_type, start_type = signature.args
        partial, xs, x_index, ws, w_index, first = args

        def x_at(k):
            return _flat_index(context, builder, x_type, xs, x_index, x_row_type, k, types.intp)

        def w_at(k):
            return _flat_index(context, builder, w_type, ws, w_index, w_row_type, k, types.intp)

        return _tail(context, builder, partial, context.cast(builder, first, start_type, types.intp),
                     (x_type, xs, x_at), (w_type, ws, w_at), kind)

    return lanes_type(acc, x, x_row, w, w_row, start), codegen


def _tail(context, builder: ir.IRBuilder, partial: ir.Value, first: ir.Value, x: tuple, w: tuple,
          kind: str | None) -> ir.Value:
    """The loop of `fma_tail` / `fma_tail_rows`: for k from ``first`` to the end of x's last
    axis, lane k - first of ``partial`` takes fma(x[x_at(k)], w[w_at(k)]) (flat indices); x
    and w are each (numba type, LLVM value, x_at / w_at)."""
    x_type, xs, x_at = x
    w_type, ws, w_at = w
    length = builder.extract_value(context.make_array(x_type)(context, builder, value=xs).shape, x_type.ndim - 1)
    result = cgutils.alloca_once_value(builder, partial)
    with cgutils.for_range(builder, builder.sub(length, first)) as loop:
        k = builder.add(first, loop.index)
        product_x = _load(context, builder, x_type, xs, x_at(k), 1, None)
        product_w = _load(context, builder, w_type, ws, w_at(k), 1, kind)
        slot = builder.trunc(loop.index, _I32)
        current = builder.load(result)
        updated = llvm_ops.fma(builder, product_x, product_w, builder.extract_element(current, slot))
        builder.store(builder.insert_element(current, updated, slot), result)
    return builder.load(result)


@njit(inline="always")
def whole(length):  # pragma: no cover - compiled
    """Elements of a ``length``-long dot product that whole groups of `LANES` cover."""
    return length - length % LANES


@intrinsic
def store(typingctx, out, row, column, acc, bias):  # pragma: no cover - compiled
    """``out[row, column] = total(acc) + bias[column]`` (without the addition where ``bias``
    is empty): a dot product's result. An intrinsic, so the arrays pass without reference
    counting (a numba helper taking them cost each result atomic reference updates)."""
    if not (isinstance(out, types.Array) and out.ndim == 2 and out.dtype == types.float32
            and isinstance(row, types.Integer) and isinstance(column, types.Integer) and acc == lanes_type
            and isinstance(bias, types.Array) and bias.ndim == 1 and bias.dtype == types.float32):
        return None

    def codegen(context, builder, signature, args):
        out_type, row_type, column_type, _, bias_type = signature.args
        target, row_index, column_index, partial, addend = args
        row_index = context.cast(builder, row_index, row_type, types.intp)
        column_index = context.cast(builder, column_index, column_type, types.intp)
        result = cgutils.alloca_once_value(builder, _sum_tree(builder, partial))
        biases = context.make_array(bias_type)(context, builder, value=addend)
        has_bias = builder.icmp_signed(">", builder.extract_value(biases.shape, 0), ir.Constant(cgutils.intp_t, 0))
        with builder.if_then(has_bias):
            pointer = cgutils.get_item_pointer(context, builder, bias_type, biases, [column_index])
            builder.store(builder.fadd(builder.load(result), builder.load(pointer)), result)
        outs = context.make_array(out_type)(context, builder, value=target)
        destination = cgutils.get_item_pointer(context, builder, out_type, outs, [row_index, column_index])
        builder.store(builder.load(result), destination)
        return context.get_dummy_value()

    return types.none(out, row, column, acc, bias), codegen


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
