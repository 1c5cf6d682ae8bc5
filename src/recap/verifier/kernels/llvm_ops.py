"""LLVM IR building blocks the kernels' intrinsics share (`lanes`, `quantized`): one fused
multiply-add and one broadcast, so each is written once."""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

_I32 = ir.IntType(32)


def fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """``a * b + c`` rounded once (``llvm.fma``), vector or scalar float32."""
    name = f"llvm.fma.v{a.type.count}f32" if isinstance(a.type, ir.VectorType) else "llvm.fma.f32"
    function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3), name)
    return builder.call(function, [a, b, c])


def broadcast(builder: ir.IRBuilder, value: ir.Value, count: int) -> ir.Value:
    """A vector of ``count`` copies of the scalar ``value``."""
    vector = ir.VectorType(value.type, count)
    single = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(single, ir.Constant(vector, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, count), [0] * count))
