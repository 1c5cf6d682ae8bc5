"""Batch-invariant linear layers for decode and verify steps: ``out = x @ w.T + bias``.

Why our own: stock ``F.linear`` on CPU picks its blocking from the batch size, so row 0 of an
8-row product is not bit-identical to the 1-row product, and 2 rows cost ~1.6x one. Here:

- **One compiled loop for every M.** ``x`` is padded to a multiple of `ROW_BLOCK` rows and
  every output element goes through the same 4x4 register block (4 weight rows x 4 token
  rows, a dot product over K vectorised by LLVM). The 4 weight rows are q, q + N/4, q + N/2,
  q + 3N/4: four long sequential streams through the matrix, which the hardware prefetcher
  follows (4 adjacent rows, read in parallel, cost 1.5x as much from DRAM on a 2-core EPYC).
  The reduction order is whatever LLVM made of that one loop (``fastmath`` allows
  reassociation and FMA *within* it), identical for every element, every M and every
  neighbour row: batch-invariant by construction.
- **Weights read once per 4 token rows**, in the model's own layout (N, K) and dtype, so
  1-8 rows cost about what the weight bytes cost to stream (memory-bound, not flop-bound).
- bfloat16 / float16 weights are widened to float32 (exactly: every 16-bit float is a
  float32) one 4-row block at a time; accumulation is float32.

Threads: the output columns are split across numba's threads (``prange``), each column's
arithmetic unchanged, so the result does not depend on the thread count either.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

ROW_BLOCK = 4
"""Token rows computed together; callers pad M up to a multiple of this."""
COL_BLOCK = 4
"""Weight rows (output columns) computed together."""
CHUNK = 8
"""Column blocks per parallel task: a task allocates its widening scratch once."""
FASTMATH = {"reassoc", "contract"}


def padded_rows(m: int) -> int:
    """Rows of the buffers an M-row step uses."""
    return -(-m // ROW_BLOCK) * ROW_BLOCK


@njit(fastmath=FASTMATH, inline="always")
def _block4(x, m0, w0, w1, w2, w3, out, n0, n1, n2, n3, bias):  # pragma: no cover - compiled
    # x: (Mp, K) f32; w0..w3: (K,) f32 weight rows n0..n3; out: (Mp, N) f32; bias: (N,) f32 or (0,)
    x0 = x[m0]
    x1 = x[m0 + 1]
    x2 = x[m0 + 2]
    x3 = x[m0 + 3]
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0)
    for k in range(x.shape[1]):
        u0 = w0[k]
        u1 = w1[k]
        u2 = w2[k]
        u3 = w3[k]
        p = x0[k]
        a00 += p * u0
        a10 += p * u1
        a20 += p * u2
        a30 += p * u3
        p = x1[k]
        a01 += p * u0
        a11 += p * u1
        a21 += p * u2
        a31 += p * u3
        p = x2[k]
        a02 += p * u0
        a12 += p * u1
        a22 += p * u2
        a32 += p * u3
        p = x3[k]
        a03 += p * u0
        a13 += p * u1
        a23 += p * u2
        a33 += p * u3
    if bias.shape[0]:
        a00 += bias[n0]
        a01 += bias[n0]
        a02 += bias[n0]
        a03 += bias[n0]
        a10 += bias[n1]
        a11 += bias[n1]
        a12 += bias[n1]
        a13 += bias[n1]
        a20 += bias[n2]
        a21 += bias[n2]
        a22 += bias[n2]
        a23 += bias[n2]
        a30 += bias[n3]
        a31 += bias[n3]
        a32 += bias[n3]
        a33 += bias[n3]
    out[m0, n0] = a00
    out[m0 + 1, n0] = a01
    out[m0 + 2, n0] = a02
    out[m0 + 3, n0] = a03
    out[m0, n1] = a10
    out[m0 + 1, n1] = a11
    out[m0 + 2, n1] = a12
    out[m0 + 3, n1] = a13
    out[m0, n2] = a20
    out[m0 + 1, n2] = a21
    out[m0 + 2, n2] = a22
    out[m0 + 3, n2] = a23
    out[m0, n3] = a30
    out[m0 + 1, n3] = a31
    out[m0 + 2, n3] = a32
    out[m0 + 3, n3] = a33


@njit(fastmath=FASTMATH, inline="always")
def _block1(x, m0, w0, out, n, bias):  # pragma: no cover - compiled
    # The last N % 4 columns: one weight row x 4 token rows (the same for every M).
    x0 = x[m0]
    x1 = x[m0 + 1]
    x2 = x[m0 + 2]
    x3 = x[m0 + 3]
    a0 = a1 = a2 = a3 = np.float32(0)
    for k in range(x.shape[1]):
        u = w0[k]
        a0 += x0[k] * u
        a1 += x1[k] * u
        a2 += x2[k] * u
        a3 += x3[k] * u
    if bias.shape[0]:
        a0 += bias[n]
        a1 += bias[n]
        a2 += bias[n]
        a3 += bias[n]
    out[m0, n] = a0
    out[m0 + 1, n] = a1
    out[m0 + 2, n] = a2
    out[m0 + 3, n] = a3


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
def linear_f32(x, w, bias, out, rows):  # pragma: no cover - compiled
    """x: (Mp, K) f32, w: (N, K) f32, bias: (N,) or (0,) f32, out: (Mp, N) f32; the first
    ``rows`` rows (a multiple of 4, <= Mp) are computed."""
    quarter = w.shape[0] // COL_BLOCK
    tasks = -(-quarter // CHUNK)
    for task in prange(tasks):
        for q in range(task * CHUNK, min(quarter, (task + 1) * CHUNK)):
            n1, n2, n3 = q + quarter, q + 2 * quarter, q + 3 * quarter
            for m0 in range(0, rows, ROW_BLOCK):
                _block4(x, m0, w[q], w[n1], w[n2], w[n3], out, q, n1, n2, n3, bias)
    for n in range(quarter * COL_BLOCK, w.shape[0]):
        for m0 in range(0, rows, ROW_BLOCK):
            _block1(x, m0, w[n], out, n, bias)


@njit(fastmath=FASTMATH, inline="always")
def _widen(w, n, table, row):  # pragma: no cover - compiled
    # weight row n of w: (N, K) uint16 bit patterns into row: (K,) f32; table: (65536,) f32
    # (float16) or (0,) (bfloat16: the bits shifted into a float32's high half)
    if table.shape[0]:
        for k in range(w.shape[1]):
            row[k] = table[w[n, k]]
    else:
        bits = row.view(np.uint32)
        for k in range(w.shape[1]):
            bits[k] = np.uint32(w[n, k]) << 16


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
def linear_u16(x, w, table, bias, out, rows):  # pragma: no cover - compiled
    """`linear_f32` for 16-bit float weights given as uint16 bit patterns (see `_widen`)."""
    quarter = w.shape[0] // COL_BLOCK
    tasks = -(-quarter // CHUNK)
    for task in prange(tasks):
        scratch = np.empty((COL_BLOCK, w.shape[1]), np.float32)
        for q in range(task * CHUNK, min(quarter, (task + 1) * CHUNK)):
            for r in range(COL_BLOCK):
                _widen(w, q + r * quarter, table, scratch[r])
            n1, n2, n3 = q + quarter, q + 2 * quarter, q + 3 * quarter
            for m0 in range(0, rows, ROW_BLOCK):
                _block4(x, m0, scratch[0], scratch[1], scratch[2], scratch[3], out, q, n1, n2, n3, bias)
    scratch = np.empty((COL_BLOCK, w.shape[1]), np.float32)
    for n in range(quarter * COL_BLOCK, w.shape[0]):
        _widen(w, n, table, scratch[0])
        for m0 in range(0, rows, ROW_BLOCK):
            _block1(x, m0, scratch[0], out, n, bias)


FLOAT16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
"""Every float16 bit pattern as float32 (exact)."""
NO_TABLE = np.zeros(0, np.float32)
NO_BIAS = np.zeros(0, np.float32)


class Linear:
    """One weight matrix in the model's own storage, ready for `linear_f32` / `linear_u16`."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None, *, float16: bool = False):
        # weight: (N, K) float32 (a view of the model's tensor) or uint16 bit patterns
        self.weight = weight
        self.bias = NO_BIAS if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
        self.table = FLOAT16_TABLE if float16 else NO_TABLE
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: np.ndarray, out: np.ndarray, rows: int) -> np.ndarray:
        """``out[:rows] = x[:rows] @ weight.T + bias``; ``rows`` a multiple of `ROW_BLOCK`."""
        if self.weight.dtype == np.float32:
            linear_f32(x, self.weight, self.bias, out, rows)
        else:
            linear_u16(x, self.weight, self.table, self.bias, out, rows)
        return out
