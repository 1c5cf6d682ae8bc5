"""Linear layers on stored GGUF blocks (`quantized`): the float path's arithmetic on weights
de-quantised once per step.

Each weight is de-quantised to the float32 the float model holds (`quantized`), then
multiplied in `lanes` order like every float block (`linear`), so a layer's output is the
float layer's, bit for bit; only the bytes read differ. By the step's rows:

- **1 or 2 token rows** (`linear_few`): a 4x1 or 4x2 register block over weight rows spread
  across the matrix (four sequential streams), reading a whole 32-weight block of each at a
  time (`lanes.load_block`: the block's scales read once, its nibble offsets constants) and
  using each de-quantised weight for every token row at once. De-quantising costs more
  arithmetic than the multiply-adds it feeds, so a whole-block step (4 groups of lanes per
  weight row per pass) is what makes it pay; a 1-row step runs no padding row. Where
  registers are 512 bits (`linear.WEIGHT_ROWS` 4) the 8x1 / 8x2 blocks run instead: 8
  weight rows, two side by side in each vector (`pairs.load_blocks`: each half its own row's
  de-quantisation and `lanes` sums, operation for operation), so each vector operation
  de-quantises and multiplies 16 weights instead of 8.
- **3 or 4 rows** (`linear_four`, 512-bit registers only): the 8x4 block the same way (16
  accumulators of two weight rows, the 4 de-quantised pairs; the x groups come from L1).
- **8, 16, 24 or 32 computed rows** (`linear_eights`, 512-bit registers only; `REGISTER_ROWS`): 4
  weight rows as two pairs against 8 token rows at a time (the 4x8 block), de-quantised
  again for each 8: for so few rows that beats writing and reading a panel.
- **12 computed rows** (`linear_twelve`, 512-bit registers only): one pair of weight rows
  against all 12 token rows (the 2x12 block: 12 accumulators), each pair de-quantised once.
- **More rows** (`linear_panels`; on AVX2 every step past 2 rows): a group of
  `linear.COL_BLOCK` (or 3) weight rows spread over the matrix is de-quantised once into a
  small float32 panel that stays in L1, then the float 4x8 and 4x4 blocks (or the 3x4 block)
  run the step's rows over it: each weight is de-quantised once a step however many rows.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from recap.verifier.kernels import lanes, pairs
from recap.verifier.kernels.lanes import GROUPS, LANES
from recap.verifier.kernels.register_blocks import (
    CHUNK,
    COL_BLOCK,
    PAIRED_ROWS,
    ROW_BLOCK,
    _block1,
    _block3,
    _rows4,
    paired_rows,
)

BLOCK = GROUPS * LANES
"""Weights a pass reads per weight row: one block of the 32-weight formats."""
PAIRED_COL_BLOCK = 2 * COL_BLOCK
"""Weight rows of the 8x1, 8x2 and 8x4 blocks: 4 pairs."""
PAIRED_CHUNK = CHUNK // 2
"""Paired column blocks per parallel task: a task covers as many weight rows as unpaired."""
REGISTER_ROWS = 32
"""Steps of a multiple of 8 computed rows up to this (5-8, 13-16, 21-24, 29-32 asked)
de-quantise in registers (`linear_eights`) where registers are 512 bits, and so do steps of
`TWELVE_ROWS` (`linear_twelve`); others once into panels (`linear_panels`): past 32 rows the
panels were faster (docs/kernels.md)."""
TWELVE_ROWS = 12
"""Computed rows of the 2x12 block (`linear_twelve`; 9-12 asked): 8 + 4 rows on the 4x8 and
a 4-row block de-quantised each pair twice and ran slower than the panels."""
PAIR_CHUNK = CHUNK * COL_BLOCK // 2
"""Weight-row pairs per parallel task of `linear_twelve`: as many weight rows as the others'."""


@njit(inline="always")
def _fma4(p0, p1, p2, p3, u0, u1, u2, u3, acc):  # pragma: no cover - compiled
    # acc after 4 consecutive groups of lanes, in increasing k (the `lanes` order)
    return lanes.fma(p3, u3, lanes.fma(p2, u2, lanes.fma(p1, u1, lanes.fma(p0, u0, acc))))


@njit(inline="always")
def _block4x1(x, w, r0, rs, out, c0, cs, bias):  # pragma: no cover - compiled
    # Token row 0 of x: (>= 1, K) f32 against weight rows r0 + j * rs (j < 4) of the stored
    # blocks w into output columns c0 + j * cs; K a multiple of BLOCK (no tail).
    w0, w1, w2, w3 = r0, r0 + rs, r0 + 2 * rs, r0 + 3 * rs
    a0 = a1 = a2 = a3 = lanes.zeros()
    for k in range(0, x.shape[1], BLOCK):
        lanes.keep_rolled()
        p0, p1 = lanes.load_row(x, 0, k), lanes.load_row(x, 0, k + LANES)
        p2, p3 = lanes.load_row(x, 0, k + 2 * LANES), lanes.load_row(x, 0, k + 3 * LANES)
        u0, u1, u2, u3 = lanes.load_block(w, w0, k)
        a0 = _fma4(p0, p1, p2, p3, u0, u1, u2, u3, a0)
        u0, u1, u2, u3 = lanes.load_block(w, w1, k)
        a1 = _fma4(p0, p1, p2, p3, u0, u1, u2, u3, a1)
        u0, u1, u2, u3 = lanes.load_block(w, w2, k)
        a2 = _fma4(p0, p1, p2, p3, u0, u1, u2, u3, a2)
        u0, u1, u2, u3 = lanes.load_block(w, w3, k)
        a3 = _fma4(p0, p1, p2, p3, u0, u1, u2, u3, a3)
    lanes.store(out, 0, c0, a0, bias)
    lanes.store(out, 0, c0 + cs, a1, bias)
    lanes.store(out, 0, c0 + 2 * cs, a2, bias)
    lanes.store(out, 0, c0 + 3 * cs, a3, bias)


@njit(inline="always")
def _block4x2(x, w, r0, rs, out, c0, cs, bias):  # pragma: no cover - compiled
    # `_block4x1` for token rows 0 (a<j>) and 1 (b<j>): each de-quantised weight used twice.
    w0, w1, w2, w3 = r0, r0 + rs, r0 + 2 * rs, r0 + 3 * rs
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = lanes.zeros()
    for k in range(0, x.shape[1], BLOCK):
        lanes.keep_rolled()
        p0, p1 = lanes.load_row(x, 0, k), lanes.load_row(x, 0, k + LANES)
        p2, p3 = lanes.load_row(x, 0, k + 2 * LANES), lanes.load_row(x, 0, k + 3 * LANES)
        r0_, r1_ = lanes.load_row(x, 1, k), lanes.load_row(x, 1, k + LANES)
        r2_, r3_ = lanes.load_row(x, 1, k + 2 * LANES), lanes.load_row(x, 1, k + 3 * LANES)
        u0, u1, u2, u3 = lanes.load_block(w, w0, k)
        a0 = _fma4(p0, p1, p2, p3, u0, u1, u2, u3, a0)
        b0 = _fma4(r0_, r1_, r2_, r3_, u0, u1, u2, u3, b0)
        u0, u1, u2, u3 = lanes.load_block(w, w1, k)
        a1 = _fma4(p0, p1, p2, p3, u0, u1, u2, u3, a1)
        b1 = _fma4(r0_, r1_, r2_, r3_, u0, u1, u2, u3, b1)
        u0, u1, u2, u3 = lanes.load_block(w, w2, k)
        a2 = _fma4(p0, p1, p2, p3, u0, u1, u2, u3, a2)
        b2 = _fma4(r0_, r1_, r2_, r3_, u0, u1, u2, u3, b2)
        u0, u1, u2, u3 = lanes.load_block(w, w3, k)
        a3 = _fma4(p0, p1, p2, p3, u0, u1, u2, u3, a3)
        b3 = _fma4(r0_, r1_, r2_, r3_, u0, u1, u2, u3, b3)
    lanes.store(out, 0, c0, a0, bias)
    lanes.store(out, 1, c0, b0, bias)
    lanes.store(out, 0, c0 + cs, a1, bias)
    lanes.store(out, 1, c0 + cs, b1, bias)
    lanes.store(out, 0, c0 + 2 * cs, a2, bias)
    lanes.store(out, 1, c0 + 2 * cs, b2, bias)
    lanes.store(out, 0, c0 + 3 * cs, a3, bias)
    lanes.store(out, 1, c0 + 3 * cs, b3, bias)


@njit(inline="always")
def _row4(x, row, k, u0, u1, u2, u3, acc):  # pragma: no cover - compiled
    # acc after token row ``row``'s weights k .. k + BLOCK - 1 times u0..u3
    return _fma4(lanes.load_row(x, row, k), lanes.load_row(x, row, k + LANES), lanes.load_row(x, row, k + 2 * LANES),
                 lanes.load_row(x, row, k + 3 * LANES), u0, u1, u2, u3, acc)


@njit(inline="always")
def _block4x4(x, m0, w, r0, rs, out, c0, cs, bias):  # pragma: no cover - compiled
    # Token rows m0 .. m0 + 3 of x against weight rows r0 + i * rs (i < 4) of the stored blocks w into
    # output columns c0 + i * cs: a<i><j> is weight row i x token row j. Each de-quantised
    # block is used for the 4 token rows at once; their x rows come from L1 (16 accumulators
    # and the 4 weight vectors hold the registers).
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = lanes.zeros()
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = lanes.zeros()
    for k in range(0, x.shape[1], BLOCK):
        lanes.keep_rolled()
        u0, u1, u2, u3 = lanes.load_block(w, r0, k)
        a00 = _row4(x, m0 + 0, k, u0, u1, u2, u3, a00)
        a01 = _row4(x, m0 + 1, k, u0, u1, u2, u3, a01)
        a02 = _row4(x, m0 + 2, k, u0, u1, u2, u3, a02)
        a03 = _row4(x, m0 + 3, k, u0, u1, u2, u3, a03)
        u0, u1, u2, u3 = lanes.load_block(w, r0 + rs, k)
        a10 = _row4(x, m0 + 0, k, u0, u1, u2, u3, a10)
        a11 = _row4(x, m0 + 1, k, u0, u1, u2, u3, a11)
        a12 = _row4(x, m0 + 2, k, u0, u1, u2, u3, a12)
        a13 = _row4(x, m0 + 3, k, u0, u1, u2, u3, a13)
        u0, u1, u2, u3 = lanes.load_block(w, r0 + 2 * rs, k)
        a20 = _row4(x, m0 + 0, k, u0, u1, u2, u3, a20)
        a21 = _row4(x, m0 + 1, k, u0, u1, u2, u3, a21)
        a22 = _row4(x, m0 + 2, k, u0, u1, u2, u3, a22)
        a23 = _row4(x, m0 + 3, k, u0, u1, u2, u3, a23)
        u0, u1, u2, u3 = lanes.load_block(w, r0 + 3 * rs, k)
        a30 = _row4(x, m0 + 0, k, u0, u1, u2, u3, a30)
        a31 = _row4(x, m0 + 1, k, u0, u1, u2, u3, a31)
        a32 = _row4(x, m0 + 2, k, u0, u1, u2, u3, a32)
        a33 = _row4(x, m0 + 3, k, u0, u1, u2, u3, a33)
    lanes.store(out, m0 + 0, c0, a00, bias)
    lanes.store(out, m0 + 1, c0, a01, bias)
    lanes.store(out, m0 + 2, c0, a02, bias)
    lanes.store(out, m0 + 3, c0, a03, bias)
    lanes.store(out, m0 + 0, c0 + cs, a10, bias)
    lanes.store(out, m0 + 1, c0 + cs, a11, bias)
    lanes.store(out, m0 + 2, c0 + cs, a12, bias)
    lanes.store(out, m0 + 3, c0 + cs, a13, bias)
    lanes.store(out, m0 + 0, c0 + 2 * cs, a20, bias)
    lanes.store(out, m0 + 1, c0 + 2 * cs, a21, bias)
    lanes.store(out, m0 + 2, c0 + 2 * cs, a22, bias)
    lanes.store(out, m0 + 3, c0 + 2 * cs, a23, bias)
    lanes.store(out, m0 + 0, c0 + 3 * cs, a30, bias)
    lanes.store(out, m0 + 1, c0 + 3 * cs, a31, bias)
    lanes.store(out, m0 + 2, c0 + 3 * cs, a32, bias)
    lanes.store(out, m0 + 3, c0 + 3 * cs, a33, bias)


@njit(inline="always")
def _pair4(p0, p1, p2, p3, u0, u1, u2, u3, acc):  # pragma: no cover - compiled
    # `_fma4` on pairs: each half, its weight row's `_fma4`
    return pairs.fma(p3, u3, pairs.fma(p2, u2, pairs.fma(p1, u1, pairs.fma(p0, u0, acc))))


@njit(inline="always")
def _row_twice(x, row, k, u0, u1, u2, u3, acc):  # pragma: no cover - compiled
    # acc after token row ``row``'s weights k .. k + BLOCK - 1 (in both halves) times u0..u3
    return _pair4(pairs.load_twice(x, row, k), pairs.load_twice(x, row, k + LANES),
                  pairs.load_twice(x, row, k + 2 * LANES), pairs.load_twice(x, row, k + 3 * LANES),
                  u0, u1, u2, u3, acc)


@njit(inline="always")
def _store_pair(out, row, c0, cs, acc, bias):  # pragma: no cover - compiled
    # a pair of weight rows' results for token row ``row``: columns c0 (low half) and c0 + cs
    lanes.store(out, row, c0, pairs.low(acc), bias)
    lanes.store(out, row, c0 + cs, pairs.high(acc), bias)


@njit(inline="always")
def _block8x1(x, w, r0, rs, out, c0, cs, bias):  # pragma: no cover - compiled
    # `_block4x1` for 8 weight rows r0 + j * rs (j < 8) into columns c0 + j * cs, two at a time
    # (`pairs.load_blocks`): a<i> holds weight rows 2i and 2i + 1, each half the `_block4x1`
    # accumulator of its row, operation for operation.
    a0 = a1 = a2 = a3 = pairs.zeros()
    for k in range(0, x.shape[1], BLOCK):
        lanes.keep_rolled()
        p0, p1 = pairs.load_twice(x, 0, k), pairs.load_twice(x, 0, k + LANES)
        p2, p3 = pairs.load_twice(x, 0, k + 2 * LANES), pairs.load_twice(x, 0, k + 3 * LANES)
        u0, u1, u2, u3 = pairs.load_blocks(w, r0, r0 + rs, k)
        a0 = _pair4(p0, p1, p2, p3, u0, u1, u2, u3, a0)
        u0, u1, u2, u3 = pairs.load_blocks(w, r0 + 2 * rs, r0 + 3 * rs, k)
        a1 = _pair4(p0, p1, p2, p3, u0, u1, u2, u3, a1)
        u0, u1, u2, u3 = pairs.load_blocks(w, r0 + 4 * rs, r0 + 5 * rs, k)
        a2 = _pair4(p0, p1, p2, p3, u0, u1, u2, u3, a2)
        u0, u1, u2, u3 = pairs.load_blocks(w, r0 + 6 * rs, r0 + 7 * rs, k)
        a3 = _pair4(p0, p1, p2, p3, u0, u1, u2, u3, a3)
    _store_pair(out, 0, c0, cs, a0, bias)
    _store_pair(out, 0, c0 + 2 * cs, cs, a1, bias)
    _store_pair(out, 0, c0 + 4 * cs, cs, a2, bias)
    _store_pair(out, 0, c0 + 6 * cs, cs, a3, bias)


@njit(inline="always")
def _block8x2(x, w, r0, rs, out, c0, cs, bias):  # pragma: no cover - compiled
    # `_block8x1` for token rows 0 (a<i>) and 1 (b<i>): each de-quantised pair used twice.
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = pairs.zeros()
    for k in range(0, x.shape[1], BLOCK):
        lanes.keep_rolled()
        p0, p1 = pairs.load_twice(x, 0, k), pairs.load_twice(x, 0, k + LANES)
        p2, p3 = pairs.load_twice(x, 0, k + 2 * LANES), pairs.load_twice(x, 0, k + 3 * LANES)
        s0, s1 = pairs.load_twice(x, 1, k), pairs.load_twice(x, 1, k + LANES)
        s2, s3 = pairs.load_twice(x, 1, k + 2 * LANES), pairs.load_twice(x, 1, k + 3 * LANES)
        u0, u1, u2, u3 = pairs.load_blocks(w, r0, r0 + rs, k)
        a0 = _pair4(p0, p1, p2, p3, u0, u1, u2, u3, a0)
        b0 = _pair4(s0, s1, s2, s3, u0, u1, u2, u3, b0)
        u0, u1, u2, u3 = pairs.load_blocks(w, r0 + 2 * rs, r0 + 3 * rs, k)
        a1 = _pair4(p0, p1, p2, p3, u0, u1, u2, u3, a1)
        b1 = _pair4(s0, s1, s2, s3, u0, u1, u2, u3, b1)
        u0, u1, u2, u3 = pairs.load_blocks(w, r0 + 4 * rs, r0 + 5 * rs, k)
        a2 = _pair4(p0, p1, p2, p3, u0, u1, u2, u3, a2)
        b2 = _pair4(s0, s1, s2, s3, u0, u1, u2, u3, b2)
        u0, u1, u2, u3 = pairs.load_blocks(w, r0 + 6 * rs, r0 + 7 * rs, k)
        a3 = _pair4(p0, p1, p2, p3, u0, u1, u2, u3, a3)
        b3 = _pair4(s0, s1, s2, s3, u0, u1, u2, u3, b3)
    _store_pair(out, 0, c0, cs, a0, bias)
    _store_pair(out, 1, c0, cs, b0, bias)
    _store_pair(out, 0, c0 + 2 * cs, cs, a1, bias)
    _store_pair(out, 1, c0 + 2 * cs, cs, b1, bias)
    _store_pair(out, 0, c0 + 4 * cs, cs, a2, bias)
    _store_pair(out, 1, c0 + 4 * cs, cs, b2, bias)
    _store_pair(out, 0, c0 + 6 * cs, cs, a3, bias)
    _store_pair(out, 1, c0 + 6 * cs, cs, b3, bias)


@njit(inline="always")
def _block8x4(x, w, r0, rs, out, c0, cs, bias):  # pragma: no cover - compiled
    # `_block4x4` for 8 weight rows, two at a time: a<i><j> is weight rows 2i and 2i + 1 x token
    # row j (16 accumulators, the 4 de-quantised pairs; each x group is loaded into both halves
    # where it is used, from L1).
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = pairs.zeros()
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = pairs.zeros()
    for k in range(0, x.shape[1], BLOCK):
        lanes.keep_rolled()
        u0, u1, u2, u3 = pairs.load_blocks(w, r0, r0 + rs, k)
        a00 = _row_twice(x, 0, k, u0, u1, u2, u3, a00)
        a01 = _row_twice(x, 1, k, u0, u1, u2, u3, a01)
        a02 = _row_twice(x, 2, k, u0, u1, u2, u3, a02)
        a03 = _row_twice(x, 3, k, u0, u1, u2, u3, a03)
        u0, u1, u2, u3 = pairs.load_blocks(w, r0 + 2 * rs, r0 + 3 * rs, k)
        a10 = _row_twice(x, 0, k, u0, u1, u2, u3, a10)
        a11 = _row_twice(x, 1, k, u0, u1, u2, u3, a11)
        a12 = _row_twice(x, 2, k, u0, u1, u2, u3, a12)
        a13 = _row_twice(x, 3, k, u0, u1, u2, u3, a13)
        u0, u1, u2, u3 = pairs.load_blocks(w, r0 + 4 * rs, r0 + 5 * rs, k)
        a20 = _row_twice(x, 0, k, u0, u1, u2, u3, a20)
        a21 = _row_twice(x, 1, k, u0, u1, u2, u3, a21)
        a22 = _row_twice(x, 2, k, u0, u1, u2, u3, a22)
        a23 = _row_twice(x, 3, k, u0, u1, u2, u3, a23)
        u0, u1, u2, u3 = pairs.load_blocks(w, r0 + 6 * rs, r0 + 7 * rs, k)
        a30 = _row_twice(x, 0, k, u0, u1, u2, u3, a30)
        a31 = _row_twice(x, 1, k, u0, u1, u2, u3, a31)
        a32 = _row_twice(x, 2, k, u0, u1, u2, u3, a32)
        a33 = _row_twice(x, 3, k, u0, u1, u2, u3, a33)
    _store_pair(out, 0, c0, cs, a00, bias)
    _store_pair(out, 1, c0, cs, a01, bias)
    _store_pair(out, 2, c0, cs, a02, bias)
    _store_pair(out, 3, c0, cs, a03, bias)
    _store_pair(out, 0, c0 + 2 * cs, cs, a10, bias)
    _store_pair(out, 1, c0 + 2 * cs, cs, a11, bias)
    _store_pair(out, 2, c0 + 2 * cs, cs, a12, bias)
    _store_pair(out, 3, c0 + 2 * cs, cs, a13, bias)
    _store_pair(out, 0, c0 + 4 * cs, cs, a20, bias)
    _store_pair(out, 1, c0 + 4 * cs, cs, a21, bias)
    _store_pair(out, 2, c0 + 4 * cs, cs, a22, bias)
    _store_pair(out, 3, c0 + 4 * cs, cs, a23, bias)
    _store_pair(out, 0, c0 + 6 * cs, cs, a30, bias)
    _store_pair(out, 1, c0 + 6 * cs, cs, a31, bias)
    _store_pair(out, 2, c0 + 6 * cs, cs, a32, bias)
    _store_pair(out, 3, c0 + 6 * cs, cs, a33, bias)


@njit(inline="always")
def _block4x8(x, m0, w, r0, rs, out, c0, cs, bias):  # pragma: no cover - compiled
    # Token rows m0 .. m0 + 7 against weight rows r0 + i * rs (i < 4) as two pairs (u: rows 0
    # and 1, into a<j>; v: rows 2 and 3, into b<j>; j the token row): 16 accumulators, the 8
    # de-quantised pairs, each x group loaded into both halves where it is used.
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = pairs.zeros()
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = pairs.zeros()
    for k in range(0, x.shape[1], BLOCK):
        lanes.keep_rolled()
        u0, u1, u2, u3 = pairs.load_blocks(w, r0, r0 + rs, k)
        v0, v1, v2, v3 = pairs.load_blocks(w, r0 + 2 * rs, r0 + 3 * rs, k)
        a0 = _row_twice(x, m0 + 0, k, u0, u1, u2, u3, a0)
        b0 = _row_twice(x, m0 + 0, k, v0, v1, v2, v3, b0)
        a1 = _row_twice(x, m0 + 1, k, u0, u1, u2, u3, a1)
        b1 = _row_twice(x, m0 + 1, k, v0, v1, v2, v3, b1)
        a2 = _row_twice(x, m0 + 2, k, u0, u1, u2, u3, a2)
        b2 = _row_twice(x, m0 + 2, k, v0, v1, v2, v3, b2)
        a3 = _row_twice(x, m0 + 3, k, u0, u1, u2, u3, a3)
        b3 = _row_twice(x, m0 + 3, k, v0, v1, v2, v3, b3)
        a4 = _row_twice(x, m0 + 4, k, u0, u1, u2, u3, a4)
        b4 = _row_twice(x, m0 + 4, k, v0, v1, v2, v3, b4)
        a5 = _row_twice(x, m0 + 5, k, u0, u1, u2, u3, a5)
        b5 = _row_twice(x, m0 + 5, k, v0, v1, v2, v3, b5)
        a6 = _row_twice(x, m0 + 6, k, u0, u1, u2, u3, a6)
        b6 = _row_twice(x, m0 + 6, k, v0, v1, v2, v3, b6)
        a7 = _row_twice(x, m0 + 7, k, u0, u1, u2, u3, a7)
        b7 = _row_twice(x, m0 + 7, k, v0, v1, v2, v3, b7)
    _store_pair(out, m0 + 0, c0, cs, a0, bias)
    _store_pair(out, m0 + 0, c0 + 2 * cs, cs, b0, bias)
    _store_pair(out, m0 + 1, c0, cs, a1, bias)
    _store_pair(out, m0 + 1, c0 + 2 * cs, cs, b1, bias)
    _store_pair(out, m0 + 2, c0, cs, a2, bias)
    _store_pair(out, m0 + 2, c0 + 2 * cs, cs, b2, bias)
    _store_pair(out, m0 + 3, c0, cs, a3, bias)
    _store_pair(out, m0 + 3, c0 + 2 * cs, cs, b3, bias)
    _store_pair(out, m0 + 4, c0, cs, a4, bias)
    _store_pair(out, m0 + 4, c0 + 2 * cs, cs, b4, bias)
    _store_pair(out, m0 + 5, c0, cs, a5, bias)
    _store_pair(out, m0 + 5, c0 + 2 * cs, cs, b5, bias)
    _store_pair(out, m0 + 6, c0, cs, a6, bias)
    _store_pair(out, m0 + 6, c0 + 2 * cs, cs, b6, bias)
    _store_pair(out, m0 + 7, c0, cs, a7, bias)
    _store_pair(out, m0 + 7, c0 + 2 * cs, cs, b7, bias)


@njit(inline="always")
def _block2x12(x, w, r0, rs, out, c0, cs, bias):  # pragma: no cover - compiled
    # Token rows 0 .. 11 against weight rows r0 and r0 + rs as one pair (a<j>: token row j):
    # 12 accumulators and the 4 de-quantised pairs, each used for all 12 rows; each x group is
    # loaded into both halves where it is used.
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = a10 = a11 = pairs.zeros()
    for k in range(0, x.shape[1], BLOCK):
        lanes.keep_rolled()
        u0, u1, u2, u3 = pairs.load_blocks(w, r0, r0 + rs, k)
        a0 = _row_twice(x, 0, k, u0, u1, u2, u3, a0)
        a1 = _row_twice(x, 1, k, u0, u1, u2, u3, a1)
        a2 = _row_twice(x, 2, k, u0, u1, u2, u3, a2)
        a3 = _row_twice(x, 3, k, u0, u1, u2, u3, a3)
        a4 = _row_twice(x, 4, k, u0, u1, u2, u3, a4)
        a5 = _row_twice(x, 5, k, u0, u1, u2, u3, a5)
        a6 = _row_twice(x, 6, k, u0, u1, u2, u3, a6)
        a7 = _row_twice(x, 7, k, u0, u1, u2, u3, a7)
        a8 = _row_twice(x, 8, k, u0, u1, u2, u3, a8)
        a9 = _row_twice(x, 9, k, u0, u1, u2, u3, a9)
        a10 = _row_twice(x, 10, k, u0, u1, u2, u3, a10)
        a11 = _row_twice(x, 11, k, u0, u1, u2, u3, a11)
    _store_pair(out, 0, c0, cs, a0, bias)
    _store_pair(out, 1, c0, cs, a1, bias)
    _store_pair(out, 2, c0, cs, a2, bias)
    _store_pair(out, 3, c0, cs, a3, bias)
    _store_pair(out, 4, c0, cs, a4, bias)
    _store_pair(out, 5, c0, cs, a5, bias)
    _store_pair(out, 6, c0, cs, a6, bias)
    _store_pair(out, 7, c0, cs, a7, bias)
    _store_pair(out, 8, c0, cs, a8, bias)
    _store_pair(out, 9, c0, cs, a9, bias)
    _store_pair(out, 10, c0, cs, a10, bias)
    _store_pair(out, 11, c0, cs, a11, bias)


@njit(inline="always")
def _unpack(w, row, panel, slot):  # pragma: no cover - compiled
    # panel[slot] = weight row ``row`` of w, de-quantised (K a multiple of BLOCK)
    for k in range(0, panel.shape[1], BLOCK):
        u0, u1, u2, u3 = lanes.load_block(w, row, k)
        lanes.put_row(panel, slot, k, u0)
        lanes.put_row(panel, slot, k + LANES, u1)
        lanes.put_row(panel, slot, k + 2 * LANES, u2)
        lanes.put_row(panel, slot, k + 3 * LANES, u3)


@njit(inline="always")
def _part_columns(x, w, bias, out, task, rows, paired):  # pragma: no cover - compiled
    # parallel task ``task`` of `linear_few` (and `linear_three`) on w: its column blocks (of
    # 8 weight rows in pairs with ``paired``, else of 4) and, for the last task, the columns
    # after them, one at a time
    blocks = w.shape[0] // (PAIRED_COL_BLOCK if paired else COL_BLOCK)
    chunk = PAIRED_CHUNK if paired else CHUNK
    for q in range(task * chunk, min(blocks, (task + 1) * chunk)):
        if paired and rows == 1:
            _block8x1(x, w, q, blocks, out, q, blocks, bias)
        elif paired:
            _block8x2(x, w, q, blocks, out, q, blocks, bias)
        elif rows == 1:
            _block4x1(x, w, q, blocks, out, q, blocks, bias)
        else:
            _block4x2(x, w, q, blocks, out, q, blocks, bias)
    if (task + 1) * chunk >= blocks:
        for n in range(blocks * (PAIRED_COL_BLOCK if paired else COL_BLOCK), w.shape[0]):
            if rows == 1:
                _block4x1(x, w, n, 0, out, n, 0, bias)
            else:
                _block4x2(x, w, n, 0, out, n, 0, bias)


# `_part_columns` as functions of their own, not inlined: `linear_three` calls one for each of
# its three weights, and inlined it compiled the same blocks three times (docs/testing.md).
@njit(cache=True, nogil=True)
def _columns(x, w, bias, out, task, rows):  # pragma: no cover - compiled
    _part_columns(x, w, bias, out, task, rows, False)


@njit(cache=True, nogil=True)
def _columns_paired(x, w, bias, out, task, rows):  # pragma: no cover - compiled
    _part_columns(x, w, bias, out, task, rows, True)


@njit(inline="always")
def _tasks(w, paired):  # pragma: no cover - compiled
    # `linear_few`'s parallel tasks for w (one for a weight of fewer rows than a column block)
    if not w.shape[0]:
        return 0
    if paired:
        return max(1, -(-(w.shape[0] // PAIRED_COL_BLOCK) // PAIRED_CHUNK))
    return max(1, -(-(w.shape[0] // COL_BLOCK) // CHUNK))


@njit(parallel=True, cache=True, nogil=True)
def linear_few(x, w, bias, out, rows):  # pragma: no cover - compiled
    """``out[:rows] = x[:rows] @ dequantised(w).T + bias`` for ``rows`` 1 or 2: x: (>= rows,
    K) f32, out: (>= rows, N) f32; output columns q, q + N/4, q + 2N/4, q + 3N/4 together
    (four sequential streams: the 4x1 / 4x2 blocks), the last N mod 4 one at a time
    (`_part_columns`). For 16-register CPUs; `linear_few_paired` where registers are 512 bits."""
    for task in prange(_tasks(w, False)):
        _columns(x, w, bias, out, task, rows)


@njit(parallel=True, cache=True, nogil=True)
def linear_few_paired(x, w, bias, out, rows):  # pragma: no cover - compiled
    """`linear_few` where registers are 512 bits (`linear.WEIGHT_ROWS` 4): output columns q,
    q + N/8, ..., q + 7N/8 together, two weight rows a vector (the 8x1 / 8x2 blocks). Its own
    function, not a flag: each compiles only its blocks."""
    for task in prange(_tasks(w, True)):
        _columns_paired(x, w, bias, out, task, rows)


@njit(parallel=True, cache=True, nogil=True)
def linear_four(x, w, bias, out):  # pragma: no cover - compiled
    """`linear_few` for steps of 3 or 4 rows (x and out hold 4) where registers are 512 bits:
    the 8x4 block over output columns q, q + N/8, ..., q + 7N/8, the last N mod 8 one at a
    time on the 4x4 block."""
    eighth = w.shape[0] // PAIRED_COL_BLOCK
    tasks = -(-eighth // PAIRED_CHUNK)
    for task in prange(tasks):
        for q in range(task * PAIRED_CHUNK, min(eighth, (task + 1) * PAIRED_CHUNK)):
            _block8x4(x, w, q, eighth, out, q, eighth, bias)
    for n in range(eighth * PAIRED_COL_BLOCK, w.shape[0]):
        _block4x4(x, 0, w, n, 0, out, n, 0, bias)


@njit(parallel=True, cache=True, nogil=True)
def linear_eights(x, w, bias, out, rows):  # pragma: no cover - compiled
    """``out[:rows] = x[:rows] @ dequantised(w).T + bias`` for ``rows`` a multiple of 8 (x and
    out hold them) where registers are 512 bits, for steps up to `REGISTER_ROWS`: per group of
    4 weight rows q, q + N/4, ... (two pairs), every 8 token rows on the 4x8 block, each time
    de-quantising again in registers (cheaper than a panel for so few rows); the last N mod 4
    columns one at a time."""
    quarter = w.shape[0] // COL_BLOCK
    tasks = -(-quarter // CHUNK)
    for task in prange(tasks):
        for q in range(task * CHUNK, min(quarter, (task + 1) * CHUNK)):
            for m0 in range(0, rows, PAIRED_ROWS):
                _block4x8(x, m0, w, q, quarter, out, q, quarter, bias)
    for n in range(quarter * COL_BLOCK, w.shape[0]):
        for m0 in range(0, rows, ROW_BLOCK):
            _block4x4(x, m0, w, n, 0, out, n, 0, bias)


@njit(parallel=True, cache=True, nogil=True)
def linear_twelve(x, w, bias, out):  # pragma: no cover - compiled
    """``out[:12] = x[:12] @ dequantised(w).T + bias`` (x and out hold `TWELVE_ROWS` rows)
    where registers are 512 bits: weight rows q and q + N/2 as one pair against the 12 token
    rows (the 2x12 block), each pair de-quantised once; the last N mod 2 columns one at a
    time on the 4x4 block."""
    half = w.shape[0] // 2
    tasks = -(-half // PAIR_CHUNK)
    for task in prange(tasks):
        for q in range(task * PAIR_CHUNK, min(half, (task + 1) * PAIR_CHUNK)):
            _block2x12(x, w, q, half, out, q, half, bias)
    for n in range(2 * half, w.shape[0]):
        for m0 in range(0, TWELVE_ROWS, ROW_BLOCK):
            _block4x4(x, m0, w, n, 0, out, n, 0, bias)


@njit(parallel=True, cache=True, nogil=True)
def linear_three(x, w0, w1, w2, b0, b1, b2, o0, o1, o2, rows):  # pragma: no cover - compiled
    """`linear_few` of three weights of one block format that read the same x (a layer's q,
    k and v; gate and up, with a w2 of no rows), in one parallel region: ``o<i>[:rows] =
    x[:rows] @ dequantised(w<i>).T + b<i>`` for ``rows`` 1 or 2. Weight i's tasks are the
    ones `linear_few` runs for it alone (`_part_columns`), each output column computed by the
    very block, so every output is, bit for bit, its own call's; the step pays one dispatch
    and one start-up of the thread pool instead of three. (Arguments, not a tuple of arrays: a
    tuple indexed per task compiled to slower blocks, and so did one function holding the 4x4
    block too: measured in docs/kernels.md.)"""
    n0 = _tasks(w0, False)
    n1 = n0 + _tasks(w1, False)
    for task in prange(n1 + _tasks(w2, False)):
        if task < n0:
            _columns(x, w0, b0, o0, task, rows)
        elif task < n1:
            _columns(x, w1, b1, o1, task - n0, rows)
        else:
            _columns(x, w2, b2, o2, task - n1, rows)


@njit(parallel=True, cache=True, nogil=True)
def linear_three_paired(x, w0, w1, w2, b0, b1, b2, o0, o1, o2, rows):  # pragma: no cover - compiled
    """`linear_three` on `linear_few_paired`'s blocks (512-bit registers)."""
    n0 = _tasks(w0, True)
    n1 = n0 + _tasks(w1, True)
    for task in prange(n1 + _tasks(w2, True)):
        if task < n0:
            _columns_paired(x, w0, b0, o0, task, rows)
        elif task < n1:
            _columns_paired(x, w1, b1, o1, task - n0, rows)
        else:
            _columns_paired(x, w2, b2, o2, task - n1, rows)


@njit(parallel=True, cache=True, nogil=True)
def linear_panels(x, w, bias, out, rows, weight_rows):  # pragma: no cover - compiled
    """``out[:rows] = x[:rows] @ dequantised(w).T + bias`` for ``rows`` a multiple of 4 (x and
    out hold them): per group of ``weight_rows`` (4 or 3) weight rows q, q + N/wr, ..., their
    weights de-quantised once into a float32 panel, then the float 4x8 / 4x4 blocks (or the
    3x4 block) over the step's tokens; the last N mod wr columns one weight row at a time."""
    span = w.shape[0] // weight_rows
    width = x.shape[1]
    tasks = -(-span // CHUNK)
    paired = paired_rows(x, rows if weight_rows == 4 else 0)
    for task in prange(tasks):
        panel = np.empty((weight_rows, width), np.float32)
        for q in range(task * CHUNK, min(span, (task + 1) * CHUNK)):
            for slot in range(weight_rows):
                _unpack(w, q + slot * span, panel, slot)
            if weight_rows == 4:
                _rows4(paired, x, rows, panel, (0, 1, 2, 3), out, (q, q + span, q + 2 * span, q + 3 * span), bias)
            else:
                for m0 in range(0, rows, ROW_BLOCK):
                    _block3(x, m0, panel, (0, 1, 2), out, (q, q + span, q + 2 * span), bias)
    panel = np.empty((1, width), np.float32)
    for n in range(span * weight_rows, w.shape[0]):
        _unpack(w, n, panel, 0)
        for m0 in range(0, rows, ROW_BLOCK):
            _block1(x, m0, panel, 0, out, n, bias)


@njit(parallel=True, cache=True, nogil=True)
def dequantize_rows(w, ids, out):  # pragma: no cover - compiled
    """``out[i] = dequantised(w[ids[i]])``: embedding rows from a stored table."""
    for i in prange(len(ids)):
        _unpack(w, ids[i], out, i)
