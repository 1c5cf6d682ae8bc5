"""Batch-invariant linear layers for decode and verify steps: ``out = x @ w.T + bias``.

Why our own: stock ``F.linear`` on CPU picks its blocking from the batch size, so row 0 of an
8-row product is not bit-identical to the 1-row product, and 2 rows cost ~1.6x one. Here:

- **One dot product, written out.** Every output element is one dot product over K in
  `lanes` order: `LANES` partial sums of fused multiply-adds in increasing k, a fixed final
  tree, then the bias. Every register block below computes each of its elements that way, so
  the block, the row count, the neighbouring rows, the thread count and the instruction set
  (AVX2, AVX-512, or none) never change a bit: by construction, not by the compiler's choice.
  `blocks_agree` still compares every block with the 4x4 block for each input width a model
  uses, and `Linear` refuses to load (`KernelDefect`) if one ever differs.
- **Blocks sized to the step.** With `WEIGHT_ROWS` 4 (32 vector registers: AVX-512), steps
  of 3 or more rows are padded to a multiple of `ROW_BLOCK` and go through a 4x4 block (4
  weight rows x 4 token rows); 1- or 2-row steps through an 8x2 block (reads each weight once
  for 2 rows instead of computing 3 padding rows; a 16x1 block for 1-row steps was slower
  on a Zen 4 core in `lanes` order, docs/kernels.md). Their weight rows are spread over the
  matrix (q, q + N/4, ...): long
  sequential streams the hardware prefetcher follows (4 adjacent rows, read in parallel,
  cost 1.5x as much from DRAM on a 2-core EPYC).
- **Weights read once per block of token rows**, in the model's own layout (N, K) and dtype,
  so 1-8 rows cost about what the weight bytes cost to stream plus the arithmetic (the two
  do not overlap on this core: docs/kernels.md). bfloat16 / float16 weights are read as
  stored and widened to float32 in registers (`lanes.load`; exact, every 16-bit float is a
  float32), so a step streams half the bytes of a float32 one.
- **The block fits the machine's registers.** The 4x4 block holds 16 accumulators and 8
  operands: with 16 vector registers (AVX2) it would spill. There (`WEIGHT_ROWS` 3) the 3x4
  block (12 accumulators) is used for every row count, over panels of `PANEL` weight-row
  groups so a step's 4 token rows stay in L1 while the panel's weight rows come from L2; a
  step of 4k + 1 or 4k + 2 rows (k >= 1) runs its last 1 or 2 rows on a 12x1 or 6x2 block
  right after the panel's 4-row blocks, while the panel's weights are still in cache (a step
  of 4k + 3 rows is padded: a 4x3 block was slower than the padding); 1- and 2-row steps
  run the 6x2 block over weight rows spread across the matrix (`linear3x4_few`: six
  sequential streams, at most one padding row). The last N mod 3 (or 4) columns go through a
  1-weight-row block. `WEIGHT_ROWS` is the machine's choice and part of a cost profile's key;
  it changes speed, never bits.

Stored GGUF blocks (`quantized`) go through `quantized_linear` instead: the same `lanes`
order on weights de-quantised in registers, so a layer on blocks gives the bits of the same
layer on the de-quantised floats.

Threads: the output columns are split across numba's threads (``prange``), each column's
arithmetic unchanged, so the result does not depend on the thread count either.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange

from recap.verifier.kernels import lanes, quantized, quantized_linear, threads
from recap.verifier.kernels.lanes import LANES
from recap.verifier.kernels.register_blocks import (  # noqa: F401 - the constants are part of this module's API
    CHUNK,
    COL_BLOCK,
    PAIRED_ROWS,
    PANEL,
    ROW_BLOCK,
    SMALL_COL_BLOCK,
    SMALL_ROWS,
    _block1,
    _block3,
    _block4,
    _rows4,
    paired_rows,
)
from recap.verifier.kernels.widen import BFLOAT16_STORAGE, FLOAT16_STORAGE, storage


def machine_weight_rows() -> int:
    """Weight rows per register block for the CPU numba compiles for: 4 with 32 vector
    registers (AVX-512), else 3 (16 registers: a 4x4 block's 24 live vectors would spill).
    The host's features, or those ``NUMBA_CPU_FEATURES`` names (a build for another CPU)."""
    import llvmlite.binding as llvm
    from numba.core import config

    if config.CPU_FEATURES is not None:
        return 4 if "+avx512f" in config.CPU_FEATURES.split(",") else 3
    return 4 if llvm.get_host_cpu_features().get("avx512f", False) else 3


WEIGHT_ROWS = machine_weight_rows()
"""The register block `Linear` uses by default here (4: 4x4 and 8x2 blocks; 3: 3x4)."""


def padded_rows(m: int) -> int:
    """Rows the buffers of an M-row step hold: 2 for M <= 2, else M rounded up to a multiple
    of 4. The 8x2 block computes a 1-row step as 2 rows, a layer without it a 1- or 2-row
    step as 4, the 4x4 block any step as this many and the 3x4 block with remainder blocks
    only the rows asked for past 4 (`Linear.__call__`)."""
    if m <= SMALL_ROWS:
        return SMALL_ROWS
    return -(-m // ROW_BLOCK) * ROW_BLOCK


@njit(inline="always")
def _block8x2(x, w, r0, rs, out, c0, cs, bias):  # pragma: no cover - compiled
    # x: (>= 2, K) f32; weight rows r0 + j * rs (j < 8) of w: (N', K) as stored into output
    # columns c0 + j * cs of out: (>= 2, N) f32; bias: (N,) f32 or (0,). a<j> is token row 0,
    # b<j> token row 1; each dot product in `lanes` order, as in `_block4`.
    x0 = 0
    x1 = 1
    w0, w1, w2, w3 = r0, r0 + rs, r0 + 2 * rs, r0 + 3 * rs
    w4, w5, w6, w7 = r0 + 4 * rs, r0 + 5 * rs, r0 + 6 * rs, r0 + 7 * rs
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = lanes.zeros()
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = lanes.zeros()
    length = x.shape[1]
    full = lanes.whole(length)
    for k in range(0, full, LANES):
        lanes.keep_rolled()
        p = lanes.load_row(x, x0, k)
        r = lanes.load_row(x, x1, k)
        u = lanes.load_row(w, w0, k)
        a0 = lanes.fma(p, u, a0)
        b0 = lanes.fma(r, u, b0)
        u = lanes.load_row(w, w1, k)
        a1 = lanes.fma(p, u, a1)
        b1 = lanes.fma(r, u, b1)
        u = lanes.load_row(w, w2, k)
        a2 = lanes.fma(p, u, a2)
        b2 = lanes.fma(r, u, b2)
        u = lanes.load_row(w, w3, k)
        a3 = lanes.fma(p, u, a3)
        b3 = lanes.fma(r, u, b3)
        u = lanes.load_row(w, w4, k)
        a4 = lanes.fma(p, u, a4)
        b4 = lanes.fma(r, u, b4)
        u = lanes.load_row(w, w5, k)
        a5 = lanes.fma(p, u, a5)
        b5 = lanes.fma(r, u, b5)
        u = lanes.load_row(w, w6, k)
        a6 = lanes.fma(p, u, a6)
        b6 = lanes.fma(r, u, b6)
        u = lanes.load_row(w, w7, k)
        a7 = lanes.fma(p, u, a7)
        b7 = lanes.fma(r, u, b7)
    # the elements past the last whole group of lanes, if any (a no-op where K % 8 == 0)
    a0 = lanes.fma_tail_rows(a0, x, x0, w, w0, full)
    b0 = lanes.fma_tail_rows(b0, x, x1, w, w0, full)
    a1 = lanes.fma_tail_rows(a1, x, x0, w, w1, full)
    b1 = lanes.fma_tail_rows(b1, x, x1, w, w1, full)
    a2 = lanes.fma_tail_rows(a2, x, x0, w, w2, full)
    b2 = lanes.fma_tail_rows(b2, x, x1, w, w2, full)
    a3 = lanes.fma_tail_rows(a3, x, x0, w, w3, full)
    b3 = lanes.fma_tail_rows(b3, x, x1, w, w3, full)
    a4 = lanes.fma_tail_rows(a4, x, x0, w, w4, full)
    b4 = lanes.fma_tail_rows(b4, x, x1, w, w4, full)
    a5 = lanes.fma_tail_rows(a5, x, x0, w, w5, full)
    b5 = lanes.fma_tail_rows(b5, x, x1, w, w5, full)
    a6 = lanes.fma_tail_rows(a6, x, x0, w, w6, full)
    b6 = lanes.fma_tail_rows(b6, x, x1, w, w6, full)
    a7 = lanes.fma_tail_rows(a7, x, x0, w, w7, full)
    b7 = lanes.fma_tail_rows(b7, x, x1, w, w7, full)
    lanes.store(out, 0, c0, a0, bias)
    lanes.store(out, 1, c0, b0, bias)
    lanes.store(out, 0, c0 + cs, a1, bias)
    lanes.store(out, 1, c0 + cs, b1, bias)
    lanes.store(out, 0, c0 + 2 * cs, a2, bias)
    lanes.store(out, 1, c0 + 2 * cs, b2, bias)
    lanes.store(out, 0, c0 + 3 * cs, a3, bias)
    lanes.store(out, 1, c0 + 3 * cs, b3, bias)
    lanes.store(out, 0, c0 + 4 * cs, a4, bias)
    lanes.store(out, 1, c0 + 4 * cs, b4, bias)
    lanes.store(out, 0, c0 + 5 * cs, a5, bias)
    lanes.store(out, 1, c0 + 5 * cs, b5, bias)
    lanes.store(out, 0, c0 + 6 * cs, a6, bias)
    lanes.store(out, 1, c0 + 6 * cs, b6, bias)
    lanes.store(out, 0, c0 + 7 * cs, a7, bias)
    lanes.store(out, 1, c0 + 7 * cs, b7, bias)


@njit(inline="always")
def _block12x1(x, m0, w, c0, ci, cj, out, bias):  # pragma: no cover - compiled
    # Token row m0 of x: (Mp, K) f32 against weight rows n = c0 + i * ci + j * cj (i < 4,
    # j < 3) of w: (N, K) as stored into output columns n of out: (Mp, N) f32; bias: (N,) f32
    # or (0,). 12 accumulators, each dot product in `lanes` order.
    x0 = m0
    c1, c2 = c0 + cj, c0 + 2 * cj
    w0, w1, w2, w3 = c0, c0 + ci, c0 + 2 * ci, c0 + 3 * ci
    w4, w5, w6, w7 = c1, c1 + ci, c1 + 2 * ci, c1 + 3 * ci
    w8, w9, w10, w11 = c2, c2 + ci, c2 + 2 * ci, c2 + 3 * ci
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = a10 = a11 = lanes.zeros()
    length = x.shape[1]
    full = lanes.whole(length)
    for k in range(0, full, LANES):
        lanes.keep_rolled()
        p = lanes.load_row(x, x0, k)
        a0 = lanes.fma(p, lanes.load_row(w, w0, k), a0)
        a1 = lanes.fma(p, lanes.load_row(w, w1, k), a1)
        a2 = lanes.fma(p, lanes.load_row(w, w2, k), a2)
        a3 = lanes.fma(p, lanes.load_row(w, w3, k), a3)
        a4 = lanes.fma(p, lanes.load_row(w, w4, k), a4)
        a5 = lanes.fma(p, lanes.load_row(w, w5, k), a5)
        a6 = lanes.fma(p, lanes.load_row(w, w6, k), a6)
        a7 = lanes.fma(p, lanes.load_row(w, w7, k), a7)
        a8 = lanes.fma(p, lanes.load_row(w, w8, k), a8)
        a9 = lanes.fma(p, lanes.load_row(w, w9, k), a9)
        a10 = lanes.fma(p, lanes.load_row(w, w10, k), a10)
        a11 = lanes.fma(p, lanes.load_row(w, w11, k), a11)
    # the elements past the last whole group of lanes, if any (a no-op where K % 8 == 0)
    a0 = lanes.fma_tail_rows(a0, x, x0, w, w0, full)
    a1 = lanes.fma_tail_rows(a1, x, x0, w, w1, full)
    a2 = lanes.fma_tail_rows(a2, x, x0, w, w2, full)
    a3 = lanes.fma_tail_rows(a3, x, x0, w, w3, full)
    a4 = lanes.fma_tail_rows(a4, x, x0, w, w4, full)
    a5 = lanes.fma_tail_rows(a5, x, x0, w, w5, full)
    a6 = lanes.fma_tail_rows(a6, x, x0, w, w6, full)
    a7 = lanes.fma_tail_rows(a7, x, x0, w, w7, full)
    a8 = lanes.fma_tail_rows(a8, x, x0, w, w8, full)
    a9 = lanes.fma_tail_rows(a9, x, x0, w, w9, full)
    a10 = lanes.fma_tail_rows(a10, x, x0, w, w10, full)
    a11 = lanes.fma_tail_rows(a11, x, x0, w, w11, full)
    lanes.store(out, m0, c0, a0, bias)
    lanes.store(out, m0, c0 + ci, a1, bias)
    lanes.store(out, m0, c0 + 2 * ci, a2, bias)
    lanes.store(out, m0, c0 + 3 * ci, a3, bias)
    lanes.store(out, m0, c1, a4, bias)
    lanes.store(out, m0, c1 + ci, a5, bias)
    lanes.store(out, m0, c1 + 2 * ci, a6, bias)
    lanes.store(out, m0, c1 + 3 * ci, a7, bias)
    lanes.store(out, m0, c2, a8, bias)
    lanes.store(out, m0, c2 + ci, a9, bias)
    lanes.store(out, m0, c2 + 2 * ci, a10, bias)
    lanes.store(out, m0, c2 + 3 * ci, a11, bias)


@njit(inline="always")
def _block6x2(x, m0, w, c0, ci, cj, out, bias):  # pragma: no cover - compiled
    # Token rows m0, m0 + 1 of x: (Mp, K) f32 against weight rows n = c0 + i * ci + j * cj
    # (i < 2, j < 3) of w into output columns n of out; as `_block12x1`, 12 accumulators.
    x0 = m0
    x1 = m0 + 1
    c1, c2 = c0 + cj, c0 + 2 * cj
    n0, n1, n2, n3, n4, n5 = c0, c0 + ci, c1, c1 + ci, c2, c2 + ci
    w0, w1, w2, w3, w4, w5 = n0, n1, n2, n3, n4, n5
    a0 = a1 = a2 = a3 = a4 = a5 = b0 = b1 = b2 = b3 = b4 = b5 = lanes.zeros()
    length = x.shape[1]
    full = lanes.whole(length)
    for k in range(0, full, LANES):
        lanes.keep_rolled()
        p = lanes.load_row(x, x0, k)
        r = lanes.load_row(x, x1, k)
        u = lanes.load_row(w, w0, k)
        a0 = lanes.fma(p, u, a0)
        b0 = lanes.fma(r, u, b0)
        u = lanes.load_row(w, w1, k)
        a1 = lanes.fma(p, u, a1)
        b1 = lanes.fma(r, u, b1)
        u = lanes.load_row(w, w2, k)
        a2 = lanes.fma(p, u, a2)
        b2 = lanes.fma(r, u, b2)
        u = lanes.load_row(w, w3, k)
        a3 = lanes.fma(p, u, a3)
        b3 = lanes.fma(r, u, b3)
        u = lanes.load_row(w, w4, k)
        a4 = lanes.fma(p, u, a4)
        b4 = lanes.fma(r, u, b4)
        u = lanes.load_row(w, w5, k)
        a5 = lanes.fma(p, u, a5)
        b5 = lanes.fma(r, u, b5)
    # the elements past the last whole group of lanes, if any (a no-op where K % 8 == 0)
    a0 = lanes.fma_tail_rows(a0, x, x0, w, w0, full)
    b0 = lanes.fma_tail_rows(b0, x, x1, w, w0, full)
    a1 = lanes.fma_tail_rows(a1, x, x0, w, w1, full)
    b1 = lanes.fma_tail_rows(b1, x, x1, w, w1, full)
    a2 = lanes.fma_tail_rows(a2, x, x0, w, w2, full)
    b2 = lanes.fma_tail_rows(b2, x, x1, w, w2, full)
    a3 = lanes.fma_tail_rows(a3, x, x0, w, w3, full)
    b3 = lanes.fma_tail_rows(b3, x, x1, w, w3, full)
    a4 = lanes.fma_tail_rows(a4, x, x0, w, w4, full)
    b4 = lanes.fma_tail_rows(b4, x, x1, w, w4, full)
    a5 = lanes.fma_tail_rows(a5, x, x0, w, w5, full)
    b5 = lanes.fma_tail_rows(b5, x, x1, w, w5, full)
    lanes.store(out, m0, n0, a0, bias)
    lanes.store(out, m0 + 1, n0, b0, bias)
    lanes.store(out, m0, n1, a1, bias)
    lanes.store(out, m0 + 1, n1, b1, bias)
    lanes.store(out, m0, n2, a2, bias)
    lanes.store(out, m0 + 1, n2, b2, bias)
    lanes.store(out, m0, n3, a3, bias)
    lanes.store(out, m0 + 1, n3, b3, bias)
    lanes.store(out, m0, n4, a4, bias)
    lanes.store(out, m0 + 1, n4, b4, bias)
    lanes.store(out, m0, n5, a5, bias)
    lanes.store(out, m0 + 1, n5, b5, bias)


@njit(inline="always")
def _split_rows(rows, remainders):  # pragma: no cover - compiled
    # (rows the 3x4 block computes, a multiple of 4; rows left to a remainder block: 0, 1 or 2)
    padded = -(-rows // ROW_BLOCK) * ROW_BLOCK
    rest = rows - (padded - ROW_BLOCK)
    if remainders and rows > ROW_BLOCK and rest <= 2:
        return padded - ROW_BLOCK, rest
    return padded, 0


@njit(inline="always")
def _remainder(x, w, first, last, third, m0, rest, out, bias):  # pragma: no cover - compiled
    # Rows m0 .. m0 + rest - 1 (rest 1 or 2) for the weight-row groups q in [first, last) of a
    # panel (weight rows and output columns q, q + third, q + 2 * third). A group left over
    # past the last whole 12x1 / 6x2 block runs the 3x4 block on rows m0 .. m0 + 3 (the
    # caller's buffers hold them).
    step = 4 if rest == 1 else 2
    q = first
    while q + step <= last:
        if rest == 1:
            _block12x1(x, m0, w, q, 1, third, out, bias)
        else:
            _block6x2(x, m0, w, q, 1, third, out, bias)
        q += step
    while q < last:
        _block3(x, m0, w, (q, q + third, q + 2 * third), out, (q, q + third, q + 2 * third), bias)
        q += 1


@njit(parallel=True, cache=True, nogil=True)
def linear4x4(x, w, bias, out, rows):  # pragma: no cover - compiled
    """x: (Mp, K) f32, w: (N, K) as stored (float32, or 16-bit float bits: `widen`), bias:
    (N,) or (0,) f32, out: (Mp, N) f32; the first ``rows`` rows (a multiple of 4, <= Mp) are
    computed: each multiple of 8 on the 4x8 block, a last 4 on the 4x4 block."""
    quarter = w.shape[0] // COL_BLOCK
    tasks = -(-quarter // CHUNK)
    paired = paired_rows(x, rows)
    for task in prange(tasks):
        for q in range(task * CHUNK, min(quarter, (task + 1) * CHUNK)):
            n1, n2, n3 = q + quarter, q + 2 * quarter, q + 3 * quarter
            _rows4(paired, x, rows, w, (q, n1, n2, n3), out, (q, n1, n2, n3), bias)
    for n in range(quarter * COL_BLOCK, w.shape[0]):
        for m0 in range(0, rows, ROW_BLOCK):
            _block1(x, m0, w, n, out, n, bias)


@njit(parallel=True, cache=True, nogil=True)
def linear8x2(x, w, bias, out):  # pragma: no cover - compiled
    """`linear4x4` for steps of 1 or 2 rows: x: (>= 2, K) f32, out: (>= 2, N) f32, N a
    multiple of 8; output columns q, q + N/8, ..., q + 7N/8 computed together."""
    eighth = w.shape[0] // SMALL_COL_BLOCK
    tasks = -(-eighth // CHUNK)
    for task in prange(tasks):
        for q in range(task * CHUNK, min(eighth, (task + 1) * CHUNK)):
            _block8x2(x, w, q, eighth, out, q, eighth, bias)


@njit(parallel=True, cache=True, nogil=True)
def linear3x4(x, w, bias, out, rows, remainders):  # pragma: no cover - compiled
    """`linear4x4` on the 3x4 block: weight rows q, q + N/3, q + 2N/3 together, in panels of
    `PANEL` such groups (one parallel task each) looped inside each 4-row block of tokens.
    ``rows``: any count; x and out hold it rounded up to a multiple of 4. With
    ``remainders``, the last 1 or 2 rows of a step past 4 rows run on the 12x1 / 6x2 block
    (the panel's weights still in cache) instead of a padded 4-row block."""
    third = w.shape[0] // 3
    full, rest = _split_rows(rows, remainders)
    tasks = -(-third // PANEL)
    for task in prange(tasks):
        first, last = task * PANEL, min(third, (task + 1) * PANEL)
        for m0 in range(0, full, ROW_BLOCK):
            for q in range(first, last):
                _block3(x, m0, w, (q, q + third, q + 2 * third), out, (q, q + third, q + 2 * third), bias)
        if rest:
            _remainder(x, w, first, last, third, full, rest, out, bias)
    for n in range(third * 3, w.shape[0]):
        for m0 in range(0, full + (ROW_BLOCK if rest else 0), ROW_BLOCK):
            _block1(x, m0, w, n, out, n, bias)


@njit(parallel=True, cache=True, nogil=True)
def linear3x4_few(x, w, bias, out):  # pragma: no cover - compiled
    """`linear3x4` for steps of 1 or 2 rows, without the 4-row block's padding: rows 0 and 1
    on the 6x2 block over weight rows q + i N/6 + j N/3 (i < 2, j < 3), six sequential
    streams. The groups past the last whole block run the 3x4 block, so x: (>= 4, K) and
    out: (>= 4, N)."""
    third = w.shape[0] // 3
    half = third // 2
    tasks = -(-half // CHUNK)
    for task in prange(tasks):
        for q in range(task * CHUNK, min(half, (task + 1) * CHUNK)):
            _block6x2(x, 0, w, q, half, third, out, bias)
    for q in range(2 * half, third):
        _block3(x, 0, w, (q, q + third, q + 2 * third), out, (q, q + third, q + 2 * third), bias)
    for n in range(third * 3, w.shape[0]):
        _block1(x, 0, w, n, out, n, bias)


NO_BIAS = np.zeros(0, np.float32)


class KernelDefect(RuntimeError):
    """Two register blocks gave different bits for one dot product: they all follow `lanes`
    order, so this is a defect in a kernel, never a property of the machine."""


class Linear:
    """One weight matrix in the model's own storage, ready for the kernels above: float32,
    16-bit float bits (`widen.storage`) or stored GGUF blocks (`quantized`, read by
    `quantized_linear`)."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None, *, float16: bool = False,
                 weight_rows: int | None = None):
        # weight: (N, K) float32 (a view of the model's tensor) or 16-bit float bit patterns
        # (bfloat16, or float16 with ``float16``), read as stored (`widen.storage`); or an
        # (N, K / 32) array of GGUF blocks (`quantized.blocks`)
        threads.start_pool()  # the checks below are parallel kernels: torch's thread count stays
        self.weight_rows = WEIGHT_ROWS if weight_rows is None else weight_rows
        """The register block: 4 (4x4, and 8x2 for 1-2 rows) or 3 (3x4 for every row count); on
        GGUF blocks, which float block runs over the de-quantised panels."""
        if self.weight_rows not in (3, 4):
            raise ValueError(f"weight_rows must be 3 or 4, got {self.weight_rows!r}")
        self.blocks = quantized.format_of(weight.dtype)
        """The GGUF block format the weights are stored in (None: floats)."""
        self.weight = read_only(weight) if self.blocks else storage(weight, float16=float16)
        bias = NO_BIAS if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
        self.bias = read_only(bias) if self.blocks else bias  # the stored kernels see one signature (`read_only`)
        self.out_features = weight.shape[0]
        self.in_features = quantized.weights_per_row(weight) if self.blocks else weight.shape[1]
        if self.blocks and self.in_features % self.blocks.block:  # pragma: no cover - whole blocks by construction
            raise ValueError(f"stored rows of {self.in_features} weights are not whole "
                             f"{self.blocks.block}-weight blocks")
        kind = _kind(self.weight)
        if not (stored_blocks_agree(self.in_features, kind, self.weight_rows) if self.blocks
                else blocks_agree(self.in_features, kind)):
            raise KernelDefect(f"the register blocks give different bits for dot products of length "
                               f"{self.in_features} ({kind} weights): a kernel no longer "
                               "follows `lanes` order")
        self.two_rows = bool(self.blocks) or (self.weight_rows == 4 and self.out_features % SMALL_COL_BLOCK == 0)
        """Whether 1- and 2-row steps compute 2 rows at most: on GGUF blocks always
        (`quantized_linear.linear_few`), on floats the 8x2 block (else they are padded to 4)."""
        self.few_rows = self.weight_rows == 3 and not self.blocks
        """Whether 1- and 2-row steps use the 6x2 block (`linear3x4_few`; the 3x4 path)."""
        self.remainders = self.weight_rows == 3 and not self.blocks
        """Whether the last 1 or 2 rows of a step past 4 rows use the 12x1 / 6x2 block (the 3x4
        path; the 4x4 block pads the step to a multiple of 4 rows)."""

    def __call__(self, x: np.ndarray, out: np.ndarray, rows: int) -> np.ndarray:
        """``out[:rows] = x[:rows] @ weight.T + bias`` for ``rows`` >= 1. The kernels compute
        whole blocks of rows: ``x`` and ``out`` need `computed_rows` rows (their content past
        ``rows`` is scratch)."""
        need = self.computed_rows(rows)
        if len(x) < need or len(out) < need:  # the kernels do not check bounds
            raise ValueError(f"this layer computes a {rows}-row step as {need} rows: x and out need as many")
        if self.blocks:
            if rows <= SMALL_ROWS and self.weight_rows == 4:
                quantized_linear.linear_few_paired(x, self.weight, self.bias, out, rows)
            elif rows <= SMALL_ROWS:
                quantized_linear.linear_few(x, self.weight, self.bias, out, rows)
            elif rows <= ROW_BLOCK and self.weight_rows == 4:
                quantized_linear.linear_four(x, self.weight, self.bias, out)
            elif need <= quantized_linear.REGISTER_ROWS and need % PAIRED_ROWS == 0 and self.weight_rows == 4:
                quantized_linear.linear_eights(x, self.weight, self.bias, out, need)
            elif need == quantized_linear.TWELVE_ROWS and self.weight_rows == 4:
                quantized_linear.linear_twelve(x, self.weight, self.bias, out)
            else:
                quantized_linear.linear_panels(x, self.weight, self.bias, out, need, self.weight_rows)
        elif rows <= SMALL_ROWS and self.few_rows:
            linear3x4_few(x, self.weight, self.bias, out)
        elif rows <= SMALL_ROWS and self.two_rows:
            linear8x2(x, self.weight, self.bias, out)
        elif self.weight_rows == 3:
            linear3x4(x, self.weight, self.bias, out, rows, self.remainders)
        else:
            linear4x4(x, self.weight, self.bias, out, need)
        return out

    def computed_rows(self, rows: int) -> int:
        """Rows of buffer a ``rows``-row step touches: 2 on the 8x2 block, else ``rows``
        rounded up to a multiple of 4 (the 3x4 block's remainder blocks and `linear3x4_few`
        compute fewer, in the same buffer)."""
        if rows <= SMALL_ROWS and self.two_rows:
            return SMALL_ROWS
        return -(-rows // ROW_BLOCK) * ROW_BLOCK


class GrownLinear:
    """A weight whose first rows are read as stored blocks and whose last rows, past the GGUF
    file's vocabulary (a token the model added, such as the demo VLM's image token), are
    floats: two `Linear` layers, each output column computed by exactly one of them, so every
    column has the bits it would have on the float weight."""

    def __init__(self, stored: Linear, grown: Linear):
        self.stored, self.grown = stored, grown
        self.blocks = stored.blocks
        self.in_features = stored.in_features
        self.out_features = stored.out_features + grown.out_features
        self.remainders = stored.remainders and grown.remainders
        """As `Linear.remainders`: both parts run the last rows of a step on remainder blocks."""
        self._grown_out = np.zeros((0, grown.out_features), np.float32)

    def __call__(self, x: np.ndarray, out: np.ndarray, rows: int) -> np.ndarray:
        """`Linear.__call__`: the stored part writes columns ``[0, stored rows)`` of ``out`` in
        place, the grown part the rest through a small buffer."""
        self.stored(x, out, rows)
        need = self.grown.computed_rows(rows)
        if len(self._grown_out) < need:
            self._grown_out = np.zeros((need, self.grown.out_features), np.float32)
        self.grown(x, self._grown_out, rows)
        out[:rows, self.stored.out_features:] = self._grown_out[:rows]
        return out

    def computed_rows(self, rows: int) -> int:
        return max(self.stored.computed_rows(rows), self.grown.computed_rows(rows))


class SameInput:
    """Two or three linear layers that read the same input in a step (a layer's q, k and v;
    gate and up), called as one. Where they are all GGUF blocks of one format, a 1- or 2-row
    step (a decode step, a small tree) runs them in one parallel kernel
    (`quantized_linear.linear_three`: each output column computed by the block that computes
    it in the layer's own call, so the same bits) and pays one dispatch and one thread-pool
    start-up instead of one per layer, which on small layers (SmolLM2's k and v) are a good
    part of their time; other steps call each layer."""

    def __init__(self, layers: tuple[Linear | GrownLinear, ...]):
        if len(layers) not in (2, 3):
            raise ValueError(f"SameInput joins 2 or 3 layers, got {len(layers)}")
        self.layers = layers
        first = layers[0]
        self.joined = all(isinstance(layer, Linear) and layer.blocks and layer.weight.dtype == first.weight.dtype
                          and layer.in_features == first.in_features and layer.weight_rows == first.weight_rows
                          for layer in layers)
        """Whether 1- and 2-row steps run as one kernel."""
        self.paired = self.joined and first.weight_rows == 4
        """Whether that kernel runs the layers' paired blocks (what each layer alone runs)."""
        self._weights: list[np.ndarray] = []
        self._biases: list[np.ndarray] = []
        if self.joined:
            # a stored layer's weight and bias are read-only (`read_only`): the no-row third
            # weight is made so too, so the kernel takes its arguments as one array type
            self._weights = [layer.weight for layer in layers]
            self._biases = [layer.bias for layer in layers]
            if len(layers) == 2:  # a third weight of no rows: no tasks
                self._weights.append(read_only(np.zeros((0, first.weight.shape[1]), first.weight.dtype)))
                self._biases.append(read_only(NO_BIAS))
        self._no_rows = np.zeros((0, 0), np.float32)

    def __call__(self, x: np.ndarray, outs: tuple[np.ndarray, ...], rows: int) -> None:
        """``outs[i][:rows] = layers[i](x)``; ``x`` and every out need `Linear.computed_rows` rows."""
        if not self.joined or rows > SMALL_ROWS:
            for layer, out in zip(self.layers, outs, strict=True):
                layer(x, out, rows)
            return
        if len(outs) != len(self.layers):
            raise ValueError(f"{len(self.layers)} layers need as many outputs, got {len(outs)}")
        if len(x) < SMALL_ROWS or any(len(out) < SMALL_ROWS for out in outs):  # the kernel does not check bounds
            raise ValueError(f"these layers compute a {rows}-row step as {SMALL_ROWS} rows: x and outs need as many")
        three = quantized_linear.linear_three_paired if self.paired else quantized_linear.linear_three
        three(x, *self._weights, *self._biases, *outs, *(self._no_rows,) * (3 - len(outs)), rows)


def read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view of ``array``, as the kernels are handed stored weights and biases:
    numba compiles a writable array as another type than a read-only one (a GGUF file's
    mapped blocks), so blocks of both kinds (the load-time check's random ones, a copy such
    as Llama's permuted q / k rows) would compile every stored kernel twice per format."""
    view = array.view()
    view.flags.writeable = False
    return view


def _kind(stored: np.ndarray) -> str:
    """The weight format a stored array holds (`widen.storage`, or a GGUF block format)."""
    blocks = quantized.format_of(stored.dtype)
    if blocks is not None:
        return blocks.name
    return {np.dtype(np.float32): "float32", np.dtype(FLOAT16_STORAGE): "float16",
            np.dtype(BFLOAT16_STORAGE): "bfloat16"}[stored.dtype]


def _sample(in_features: int, columns: int, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seeded random (weights as stored, bias, 4 rows of x) for the block checks."""
    rng = np.random.default_rng(in_features)
    weight = rng.standard_normal((columns, in_features), dtype=np.float32)
    if kind == "float16":
        weight = storage(weight.astype(np.float16).view(np.uint16), float16=True)
    elif kind == "bfloat16":
        weight = storage((weight.view(np.uint32) >> 16).astype(np.uint16))
    bias = rng.standard_normal(columns, dtype=np.float32)
    return weight, bias, rng.standard_normal((ROW_BLOCK, in_features), dtype=np.float32)


def _four_rows(x: np.ndarray, stored: np.ndarray, bias: np.ndarray) -> np.ndarray:
    four = np.zeros((ROW_BLOCK, len(stored)), np.float32)
    linear4x4(x, stored, bias, four, ROW_BLOCK)
    return four


@functools.cache
def few_rows_exact(in_features: int, kind: str = "float32") -> bool:
    """Whether `linear3x4_few` gives, bit for bit, rows 0 and 1 of a 4-row step on the 3x4
    block (see `small_rows_exact`), over two parallel tasks of 6x2 blocks, a leftover group
    and a last column."""
    columns = 3 * (2 * (CHUNK + 1) + 1) + 1
    stored, bias, x = _sample(in_features, columns, kind)
    four, few = np.zeros((ROW_BLOCK, columns), np.float32), np.zeros((ROW_BLOCK, columns), np.float32)
    linear3x4(x, stored, bias, four, ROW_BLOCK, False)
    linear3x4_few(x, stored, bias, few)
    return few[:SMALL_ROWS].tobytes() == four[:SMALL_ROWS].tobytes()


@functools.cache
def small_rows_exact(in_features: int, kind: str = "float32") -> bool:
    """Whether the 8x2 block gives, bit for bit, what the 4x4 block gives for dot products
    of length ``in_features`` (``kind``: the weights' dtype name), on random numbers (one of
    the checks `blocks_agree` runs)."""
    stored, bias, x = _sample(in_features, 2 * SMALL_COL_BLOCK, kind)
    two = np.zeros((SMALL_ROWS, len(stored)), np.float32)
    linear8x2(x, stored, bias, two)
    return _four_rows(x, stored, bias)[:SMALL_ROWS].tobytes() == two.tobytes()


@functools.cache
def remainder_rows_exact(in_features: int, kind: str = "float32") -> bool:
    """Whether the 12x1 and 6x2 blocks give, bit for bit, what the 3x4 block gives for dot
    products of length ``in_features`` (see `small_rows_exact`): steps of 5
    and 6 rows (their last 1 and 2 rows on the remainder blocks) against the same rows of an
    8-row step (all on the 3x4 block), over a panel and a half of columns so the whole
    blocks, a leftover group and the last N mod 3 columns are all compared."""
    columns = 3 * (PANEL + PANEL // 2 + 1) + 1
    stored, bias, x = _sample(in_features, columns, kind)
    x = np.concatenate([x, x[::-1] * np.float32(0.5)])
    results = {}
    for rows, remainders in ((5, True), (6, True), (8, False)):
        out = np.zeros((2 * ROW_BLOCK, columns), np.float32)
        linear3x4(x, stored, bias, out, rows, remainders)
        results[rows] = out
    return all(results[rows][:rows].tobytes() == results[8][:rows].tobytes() for rows in (5, 6))


def _rows_in_fours(x: np.ndarray, stored: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """x's rows through the 4x4 block, 4 rows at a time (the reference for longer steps)."""
    return np.concatenate([_four_rows(x[m:m + ROW_BLOCK], stored, bias) for m in range(0, len(x), ROW_BLOCK)])


def _twelve_rows(rng: np.random.Generator, in_features: int) -> np.ndarray:
    """12 token rows: a step on the 4x8 block (8 rows) and the 4x4 block (4)."""
    return rng.standard_normal((PAIRED_ROWS + ROW_BLOCK, in_features), dtype=np.float32)


@functools.cache
def paired_rows_exact(in_features: int, kind: str = "float32") -> bool:
    """Whether a 12-row step of `linear4x4` (rows 0-7 on the 4x8 block, 8-11 on the 4x4
    block) gives, bit for bit, what the 4x4 block gives each 4 of its rows alone (see
    `small_rows_exact`), over two parallel tasks and the last N mod 4 columns."""
    stored, bias, _ = _sample(in_features, 4 * (CHUNK + 1) + 3, kind)
    x = _twelve_rows(np.random.default_rng(in_features + 1), in_features)
    out = np.zeros((len(x), len(stored)), np.float32)
    linear4x4(x, stored, bias, out, len(x))
    return out.tobytes() == _rows_in_fours(x, stored, bias).tobytes()


@functools.cache
def blocks_agree(in_features: int, kind: str = "float32") -> bool:
    """Whether every register block gives the 4x4 block's bits on random dot products of
    length ``in_features`` (``kind``: the weights' dtype name), both weight-row layouts and
    the remainder blocks included. Every block follows `lanes` order, so this holds by
    construction: `Linear` asserts it once per width and dtype, so a kernel edited out of
    that order is refused at load instead of changing a logit."""
    stored, bias, x = _sample(in_features, 3 * 4 * SMALL_COL_BLOCK + 2, kind)
    four, three = _four_rows(x, stored, bias), np.zeros((ROW_BLOCK, len(stored)), np.float32)
    linear3x4(x, stored, bias, three, ROW_BLOCK, False)
    return (three.tobytes() == four.tobytes() and small_rows_exact(in_features, kind)
            and few_rows_exact(in_features, kind) and remainder_rows_exact(in_features, kind)
            and paired_rows_exact(in_features, kind))


@functools.cache
def stored_blocks_agree(in_features: int, kind: str, weight_rows: int) -> bool:
    """Whether the kernels over stored ``kind`` blocks that a layer of ``weight_rows`` runs
    (`quantized_linear`; 4: the paired 1- and 2-row blocks, the 8x4, 4x8 and 2x12 blocks and
    the panels under the 4x8 / 4x4 blocks; 3: the 4x1 / 4x2 blocks and the panels under the 3x4
    block) give the bits the float 4x4 block gives on the ``gguf`` package's de-quantisation
    of the same random blocks: what makes a model read as stored bit-identical to its float
    copy. `Linear` asserts it once per width, format and layout (only what it runs is
    compiled)."""
    rng = np.random.default_rng(in_features)
    columns = 3 * 4 * SMALL_COL_BLOCK + 2 * 8 + 1
    stored = read_only(quantized.random_blocks(rng, columns, in_features, kind))  # as layers hold them
    bias = read_only(rng.standard_normal(columns, dtype=np.float32))
    x = rng.standard_normal((ROW_BLOCK, in_features), dtype=np.float32)
    want = _four_rows(x, quantized.dequantize(stored), bias)
    few_rows = quantized_linear.linear_few_paired if weight_rows == 4 else quantized_linear.linear_few
    ok = True
    for rows in (1, 2):
        few = np.zeros((ROW_BLOCK, columns), np.float32)
        few_rows(x, stored, bias, few, rows)
        ok &= few[:rows].tobytes() == want[:rows].tobytes()
    panels = np.zeros((ROW_BLOCK, columns), np.float32)
    quantized_linear.linear_panels(x, stored, bias, panels, ROW_BLOCK, weight_rows)
    ok &= panels.tobytes() == want.tobytes()
    if weight_rows == 3:
        return bool(ok)
    four = np.zeros((ROW_BLOCK, columns), np.float32)
    quantized_linear.linear_four(x, stored, bias, four)
    ok &= four.tobytes() == want.tobytes()
    weights = quantized.dequantize(stored)
    x = _twelve_rows(rng, in_features)  # the 4x8 block over the panels, then the 4x4
    panels = np.zeros((len(x), columns), np.float32)
    quantized_linear.linear_panels(x, stored, bias, panels, len(x), 4)
    ok &= panels.tobytes() == _rows_in_fours(x, weights, bias).tobytes()
    x = rng.standard_normal((2 * PAIRED_ROWS, in_features), dtype=np.float32)  # two 4x8 blocks in registers
    eights = np.zeros((len(x), columns), np.float32)
    quantized_linear.linear_eights(x, stored, bias, eights, len(x))
    ok &= eights.tobytes() == _rows_in_fours(x, weights, bias).tobytes()
    x = x[:quantized_linear.TWELVE_ROWS]  # the 2x12 block, and an odd last column on the 4x4
    twelve = np.zeros((len(x), columns), np.float32)
    quantized_linear.linear_twelve(x, stored, bias, twelve)
    return bool(ok and twelve.tobytes() == _rows_in_fours(x, weights, bias).tobytes())
