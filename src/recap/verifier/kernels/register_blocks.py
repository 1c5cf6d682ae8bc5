"""The float register blocks every linear kernel is built from: 4x8, 4x4, 3x4 and one weight
row by 4 token rows, each dot product in `lanes` order (`linear` explains the layouts; the
blocks over stored GGUF weights in `quantized_linear` run these over de-quantised panels).
Their own module so both kernels' modules import them without importing each other."""

from __future__ import annotations

import numpy as np
from numba import njit

from recap.verifier.kernels import lanes, pairs
from recap.verifier.kernels.lanes import LANES

ROW_BLOCK = 4
"""Token rows computed together; callers pad M > 2 up to a multiple of this."""
COL_BLOCK = 4
"""Weight rows (output columns) computed together."""
SMALL_ROWS = 2
"""Steps of at most this many rows use the 8x2 block (padded to 2 rows)."""
SMALL_COL_BLOCK = 8
"""Weight rows computed together by the 8x2 block."""
CHUNK = 8
"""Column blocks per parallel task."""
PANEL = 8
"""3x4 block: weight-row groups computed for one 4-row block of tokens before the next."""
PAIRED_ROWS = 8
"""Token rows of the 4x8 block (`_block4x8`): steps of 8 rows and more run their first
multiple of 8 rows on it, the last 4 (if any) on the 4x4 block."""



@njit(inline="always")
def _block4(x, m0, w, rows, out, columns, bias):  # pragma: no cover - compiled
    # x: (Mp, K) f32; rows (w0, w1, w2, w3): rows of w: (N', K) as stored, into output
    # columns (n0, n1, n2, n3) of out: (Mp, N) f32; bias: (N,) f32 or (0,). 16 dot products in
    # `lanes` order: a<i><j> is weight row i x token row j. x0..x3 and w0..w3 are row
    # indices, not views: a view is a reference-counted object (two atomic updates each), a
    # row index costs nothing (and a tuple of them, inlined, is unpacked into registers).
    w0, w1, w2, w3 = rows
    n0, n1, n2, n3 = columns
    x0 = m0
    x1 = m0 + 1
    x2 = m0 + 2
    x3 = m0 + 3
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = lanes.zeros()
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = lanes.zeros()
    length = x.shape[1]
    full = lanes.whole(length)
    for k in range(0, full, LANES):
        lanes.keep_rolled()
        u0 = lanes.load_row(w, w0, k)
        u1 = lanes.load_row(w, w1, k)
        u2 = lanes.load_row(w, w2, k)
        u3 = lanes.load_row(w, w3, k)
        p = lanes.load_row(x, x0, k)
        a00 = lanes.fma(p, u0, a00)
        a10 = lanes.fma(p, u1, a10)
        a20 = lanes.fma(p, u2, a20)
        a30 = lanes.fma(p, u3, a30)
        p = lanes.load_row(x, x1, k)
        a01 = lanes.fma(p, u0, a01)
        a11 = lanes.fma(p, u1, a11)
        a21 = lanes.fma(p, u2, a21)
        a31 = lanes.fma(p, u3, a31)
        p = lanes.load_row(x, x2, k)
        a02 = lanes.fma(p, u0, a02)
        a12 = lanes.fma(p, u1, a12)
        a22 = lanes.fma(p, u2, a22)
        a32 = lanes.fma(p, u3, a32)
        p = lanes.load_row(x, x3, k)
        a03 = lanes.fma(p, u0, a03)
        a13 = lanes.fma(p, u1, a13)
        a23 = lanes.fma(p, u2, a23)
        a33 = lanes.fma(p, u3, a33)
    # the elements past the last whole group of lanes, if any (a no-op where K % 8 == 0)
    a00 = lanes.fma_tail_rows(a00, x, x0, w, w0, full)
    a01 = lanes.fma_tail_rows(a01, x, x1, w, w0, full)
    a02 = lanes.fma_tail_rows(a02, x, x2, w, w0, full)
    a03 = lanes.fma_tail_rows(a03, x, x3, w, w0, full)
    a10 = lanes.fma_tail_rows(a10, x, x0, w, w1, full)
    a11 = lanes.fma_tail_rows(a11, x, x1, w, w1, full)
    a12 = lanes.fma_tail_rows(a12, x, x2, w, w1, full)
    a13 = lanes.fma_tail_rows(a13, x, x3, w, w1, full)
    a20 = lanes.fma_tail_rows(a20, x, x0, w, w2, full)
    a21 = lanes.fma_tail_rows(a21, x, x1, w, w2, full)
    a22 = lanes.fma_tail_rows(a22, x, x2, w, w2, full)
    a23 = lanes.fma_tail_rows(a23, x, x3, w, w2, full)
    a30 = lanes.fma_tail_rows(a30, x, x0, w, w3, full)
    a31 = lanes.fma_tail_rows(a31, x, x1, w, w3, full)
    a32 = lanes.fma_tail_rows(a32, x, x2, w, w3, full)
    a33 = lanes.fma_tail_rows(a33, x, x3, w, w3, full)
    lanes.store(out, m0, n0, a00, bias)
    lanes.store(out, m0 + 1, n0, a01, bias)
    lanes.store(out, m0 + 2, n0, a02, bias)
    lanes.store(out, m0 + 3, n0, a03, bias)
    lanes.store(out, m0, n1, a10, bias)
    lanes.store(out, m0 + 1, n1, a11, bias)
    lanes.store(out, m0 + 2, n1, a12, bias)
    lanes.store(out, m0 + 3, n1, a13, bias)
    lanes.store(out, m0, n2, a20, bias)
    lanes.store(out, m0 + 1, n2, a21, bias)
    lanes.store(out, m0 + 2, n2, a22, bias)
    lanes.store(out, m0 + 3, n2, a23, bias)
    lanes.store(out, m0, n3, a30, bias)
    lanes.store(out, m0 + 1, n3, a31, bias)
    lanes.store(out, m0 + 2, n3, a32, bias)
    lanes.store(out, m0 + 3, n3, a33, bias)


@njit(inline="always")
def _block1(x, m0, w, w0, out, n, bias):  # pragma: no cover - compiled
    # The last N % 3 (or N % 4) columns: one weight row x 4 token rows.
    x0 = m0
    x1 = m0 + 1
    x2 = m0 + 2
    x3 = m0 + 3
    a0 = a1 = a2 = a3 = lanes.zeros()
    length = x.shape[1]
    full = lanes.whole(length)
    for k in range(0, full, LANES):
        lanes.keep_rolled()
        u = lanes.load_row(w, w0, k)
        a0 = lanes.fma(lanes.load_row(x, x0, k), u, a0)
        a1 = lanes.fma(lanes.load_row(x, x1, k), u, a1)
        a2 = lanes.fma(lanes.load_row(x, x2, k), u, a2)
        a3 = lanes.fma(lanes.load_row(x, x3, k), u, a3)
    # the elements past the last whole group of lanes, if any (a no-op where K % 8 == 0)
    a0 = lanes.fma_tail_rows(a0, x, x0, w, w0, full)
    a1 = lanes.fma_tail_rows(a1, x, x1, w, w0, full)
    a2 = lanes.fma_tail_rows(a2, x, x2, w, w0, full)
    a3 = lanes.fma_tail_rows(a3, x, x3, w, w0, full)
    lanes.store(out, m0, n, a0, bias)
    lanes.store(out, m0 + 1, n, a1, bias)
    lanes.store(out, m0 + 2, n, a2, bias)
    lanes.store(out, m0 + 3, n, a3, bias)


@njit(inline="always")
def _block3(x, m0, w, rows, out, columns, bias):  # pragma: no cover - compiled
    # x: (Mp, K) f32; rows (w0, w1, w2): rows of w as stored, into output columns (n0, n1,
    # n2) of out: (Mp, N) f32; bias: (N,) f32 or (0,). `_block4` with 3 weight rows: 12
    # accumulators fit 16 vector registers.
    w0, w1, w2 = rows
    n0, n1, n2 = columns
    x0 = m0
    x1 = m0 + 1
    x2 = m0 + 2
    x3 = m0 + 3
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = lanes.zeros()
    a20 = a21 = a22 = a23 = lanes.zeros()
    length = x.shape[1]
    full = lanes.whole(length)
    for k in range(0, full, LANES):
        lanes.keep_rolled()
        u0 = lanes.load_row(w, w0, k)
        u1 = lanes.load_row(w, w1, k)
        u2 = lanes.load_row(w, w2, k)
        p = lanes.load_row(x, x0, k)
        a00 = lanes.fma(p, u0, a00)
        a10 = lanes.fma(p, u1, a10)
        a20 = lanes.fma(p, u2, a20)
        p = lanes.load_row(x, x1, k)
        a01 = lanes.fma(p, u0, a01)
        a11 = lanes.fma(p, u1, a11)
        a21 = lanes.fma(p, u2, a21)
        p = lanes.load_row(x, x2, k)
        a02 = lanes.fma(p, u0, a02)
        a12 = lanes.fma(p, u1, a12)
        a22 = lanes.fma(p, u2, a22)
        p = lanes.load_row(x, x3, k)
        a03 = lanes.fma(p, u0, a03)
        a13 = lanes.fma(p, u1, a13)
        a23 = lanes.fma(p, u2, a23)
    # the elements past the last whole group of lanes, if any (a no-op where K % 8 == 0)
    a00 = lanes.fma_tail_rows(a00, x, x0, w, w0, full)
    a01 = lanes.fma_tail_rows(a01, x, x1, w, w0, full)
    a02 = lanes.fma_tail_rows(a02, x, x2, w, w0, full)
    a03 = lanes.fma_tail_rows(a03, x, x3, w, w0, full)
    a10 = lanes.fma_tail_rows(a10, x, x0, w, w1, full)
    a11 = lanes.fma_tail_rows(a11, x, x1, w, w1, full)
    a12 = lanes.fma_tail_rows(a12, x, x2, w, w1, full)
    a13 = lanes.fma_tail_rows(a13, x, x3, w, w1, full)
    a20 = lanes.fma_tail_rows(a20, x, x0, w, w2, full)
    a21 = lanes.fma_tail_rows(a21, x, x1, w, w2, full)
    a22 = lanes.fma_tail_rows(a22, x, x2, w, w2, full)
    a23 = lanes.fma_tail_rows(a23, x, x3, w, w2, full)
    lanes.store(out, m0, n0, a00, bias)
    lanes.store(out, m0 + 1, n0, a01, bias)
    lanes.store(out, m0 + 2, n0, a02, bias)
    lanes.store(out, m0 + 3, n0, a03, bias)
    lanes.store(out, m0, n1, a10, bias)
    lanes.store(out, m0 + 1, n1, a11, bias)
    lanes.store(out, m0 + 2, n1, a12, bias)
    lanes.store(out, m0 + 3, n1, a13, bias)
    lanes.store(out, m0, n2, a20, bias)
    lanes.store(out, m0 + 1, n2, a21, bias)
    lanes.store(out, m0 + 2, n2, a22, bias)
    lanes.store(out, m0 + 3, n2, a23, bias)


@njit(inline="always")
def _finish_pair(acc, x, m, w, w_row, full, out, n, bias):  # pragma: no cover - compiled
    # token rows m and m + 1 of a pair accumulator: their tails (past ``full``) and results
    lanes.store(out, m, n, lanes.fma_tail_rows(pairs.low(acc), x, m, w, w_row, full), bias)
    lanes.store(out, m + 1, n, lanes.fma_tail_rows(pairs.high(acc), x, m + 1, w, w_row, full), bias)


@njit(inline="always")
def _block4x8(paired, x, m0, w, rows, out, columns, bias):  # pragma: no cover - compiled
    # `_block4` for 8 token rows m0 .. m0 + 7 (m0 even), read from ``paired`` (`pairs.interleave`
    # of x: pair j holds rows 2j and 2j + 1); x itself only for the tails. a<i><j> holds weight
    # row i x token rows m0 + 2j and m0 + 2j + 1: 16 accumulators of 16 floats, each half the
    # `_block4` accumulator of its row, operation for operation (`pairs`).
    w0, w1, w2, w3 = rows
    n0, n1, n2, n3 = columns
    j0 = m0 // 2
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = pairs.zeros()
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = pairs.zeros()
    full = lanes.whole(x.shape[1])
    for k in range(0, full, LANES):
        lanes.keep_rolled()
        u0 = pairs.load_twice(w, w0, k)
        u1 = pairs.load_twice(w, w1, k)
        u2 = pairs.load_twice(w, w2, k)
        u3 = pairs.load_twice(w, w3, k)
        p = pairs.load(paired, j0, k)
        a00 = pairs.fma(p, u0, a00)
        a10 = pairs.fma(p, u1, a10)
        a20 = pairs.fma(p, u2, a20)
        a30 = pairs.fma(p, u3, a30)
        p = pairs.load(paired, j0 + 1, k)
        a01 = pairs.fma(p, u0, a01)
        a11 = pairs.fma(p, u1, a11)
        a21 = pairs.fma(p, u2, a21)
        a31 = pairs.fma(p, u3, a31)
        p = pairs.load(paired, j0 + 2, k)
        a02 = pairs.fma(p, u0, a02)
        a12 = pairs.fma(p, u1, a12)
        a22 = pairs.fma(p, u2, a22)
        a32 = pairs.fma(p, u3, a32)
        p = pairs.load(paired, j0 + 3, k)
        a03 = pairs.fma(p, u0, a03)
        a13 = pairs.fma(p, u1, a13)
        a23 = pairs.fma(p, u2, a23)
        a33 = pairs.fma(p, u3, a33)
    _finish_pair(a00, x, m0, w, w0, full, out, n0, bias)
    _finish_pair(a01, x, m0 + 2, w, w0, full, out, n0, bias)
    _finish_pair(a02, x, m0 + 4, w, w0, full, out, n0, bias)
    _finish_pair(a03, x, m0 + 6, w, w0, full, out, n0, bias)
    _finish_pair(a10, x, m0, w, w1, full, out, n1, bias)
    _finish_pair(a11, x, m0 + 2, w, w1, full, out, n1, bias)
    _finish_pair(a12, x, m0 + 4, w, w1, full, out, n1, bias)
    _finish_pair(a13, x, m0 + 6, w, w1, full, out, n1, bias)
    _finish_pair(a20, x, m0, w, w2, full, out, n2, bias)
    _finish_pair(a21, x, m0 + 2, w, w2, full, out, n2, bias)
    _finish_pair(a22, x, m0 + 4, w, w2, full, out, n2, bias)
    _finish_pair(a23, x, m0 + 6, w, w2, full, out, n2, bias)
    _finish_pair(a30, x, m0, w, w3, full, out, n3, bias)
    _finish_pair(a31, x, m0 + 2, w, w3, full, out, n3, bias)
    _finish_pair(a32, x, m0 + 4, w, w3, full, out, n3, bias)
    _finish_pair(a33, x, m0 + 6, w, w3, full, out, n3, bias)


@njit(inline="always")
def paired_rows(x, rows):  # pragma: no cover - compiled
    """`pairs.interleave` of the first multiple of `PAIRED_ROWS` of x's ``rows`` rows: what
    `_rows4` reads them from (a copy of M x K floats, against the M x N x K multiply-adds)."""
    eights = rows - rows % PAIRED_ROWS
    paired = np.empty((eights // 2, 2 * x.shape[1]), np.float32)
    pairs.interleave(x, eights, paired)
    return paired


@njit(inline="always")
def _rows4(paired, x, m_end, w, rows, out, columns, bias):  # pragma: no cover - compiled
    # token rows 0 .. m_end - 1 (a multiple of 4) against one group of 4 weight rows: the
    # 4x8 block over the first multiple of 8 rows (x interleaved into ``paired`` for them),
    # the 4x4 block over the last 4 if any
    eights = m_end - m_end % PAIRED_ROWS
    for m0 in range(0, eights, PAIRED_ROWS):
        _block4x8(paired, x, m0, w, rows, out, columns, bias)
    for m0 in range(eights, m_end, ROW_BLOCK):
        _block4(x, m0, w, rows, out, columns, bias)
