"""Batch-invariant linear layers for decode and verify steps: ``out = x @ w.T + bias``.

Why our own: stock ``F.linear`` on CPU picks its blocking from the batch size, so row 0 of an
8-row product is not bit-identical to the 1-row product, and 2 rows cost ~1.6x one. Here:

- **One dot product for every M.** Every output element is one dot product over K that LLVM
  vectorises the same way in each register block: one vector accumulator per element
  (``fastmath`` allows reassociation and FMA *within* that loop), then the same horizontal
  sum. With ``WEIGHT_ROWS`` 4 (AVX-512), steps of 3 or more rows are padded to a multiple of
  `ROW_BLOCK` and go through a 4x4 block (4 weight rows x 4 token rows); steps of 1 or 2
  rows go through an 8x2 block (8 weight rows x 2 token rows), which reads each weight once
  for 2 rows instead of computing 3 padding rows: a 1-row step's linear layers take about
  12% less time (SmolLM2, one core, `benchmarks/step_profile.py`); steps of exactly 1 row
  go through a 16x1 block (16 weight rows x the one token row), which computes no padding
  row at all: about 5% less than the 8x2 block on an Intel AVX-512 core. All three blocks
  hold 16 accumulators, and their weight rows are spread over the matrix (q, q + N/4, ...):
  long sequential streams the hardware prefetcher follows (4 adjacent rows, read in
  parallel, cost 1.5x as much from DRAM on a 2-core EPYC).
- **Checked on the machine, not assumed.** That both blocks compile to the same arithmetic
  is LLVM's choice, so `small_rows_exact` and `one_row_exact` compare them bit for bit for
  each input width a model uses before the 2-row or 1-row block is used (`Linear` calls
  them); where they differ, the step is padded to 2 or 4 rows as before. The row count never
  changes an element's bits. (Blocks with fewer accumulators, 8x1 or 4x1, were faster still
  at one row but LLVM interleaves their loops and rounds otherwise: not used.)
- **Weights read once per block of token rows**, in the model's own layout (N, K) and dtype,
  so 1-8 rows cost about what the weight bytes cost to stream plus the arithmetic (the two
  do not overlap on this core: docs/kernels.md).
- bfloat16 / float16 weights are read as stored and widened to float32 in registers, inside
  the dot product (`widen`: exact, every 16-bit float is a float32), so a step streams half
  the bytes of a float32 one; accumulation is float32. (Widening a panel into float32
  scratch first, as before, made bfloat16 steps slower than float32 ones.)
- **The block fits the machine's registers.** The 4x4 block holds 16 accumulators and 8
  operands: on a core with 32 vector registers (AVX-512) it runs near the core's peak, but
  with 16 (AVX2) it spills. There the 3x4 block (12 accumulators, 3 weight rows x 4 token
  rows) is used for every row count, over panels of `PANEL` weight-row groups so a step's 4
  token rows stay in L1 while the panel's weight rows come from L2 (1.4-1.6x faster at 8-64
  rows on a Zen 3 core, `benchmarks/linear_blocks.py`). Both blocks run the same dot
  product (LLVM vectorises both loops alike: equal bits on the columns both cover, tested);
  the last N mod 3 (or 4) columns go through a 1-weight-row block that may round otherwise,
  so bits can differ between the choices, never between row counts. `WEIGHT_ROWS` is the
  machine's choice, and it is part of a cost profile's key.
- **No padding rows past 4 on the 3x4 block.** A step of 4k + 1 or 4k + 2 rows (k >= 1)
  runs its last 1 or 2 rows on a 12x1 or 6x2 block (12 accumulators each, the same dot
  product), right after the panel's 4-row blocks, while the panel's weights are still in
  cache: on a Zen 3 core SmolLM2's layers take 15% less at 5 rows than padded to 8, and
  10-12% less at 9-10 rows than padded to 12. `remainder_rows_exact` checks the bits on the machine, as for the
  2-row block; a step of 4k + 3 rows is padded (a 4x3 block was slower than the padding).
  A 1- or 2-row step would pay for 4 rows of arithmetic on the 3x4 block, so it runs the
  6x2 block over weight rows spread across the matrix instead (`linear3x4_few`: six
  sequential streams, at most one padding row; `few_rows_exact` checks its bits on the
  machine).

Threads: the output columns are split across numba's threads (``prange``), each column's
arithmetic unchanged, so the result does not depend on the thread count either.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange

from recap.target.kernels.widen import BFLOAT16_STORAGE, FLOAT16_STORAGE, storage, widen

ROW_BLOCK = 4
"""Token rows computed together; callers pad M > 2 up to a multiple of this."""
COL_BLOCK = 4
"""Weight rows (output columns) computed together."""
SMALL_ROWS = 2
"""Steps of at most this many rows use the 8x2 block (padded to 2 rows)."""
SMALL_COL_BLOCK = 8
"""Weight rows computed together by the 8x2 block."""
ONE_COL_BLOCK = 16
"""Weight rows computed together by the 16x1 block (1-row steps)."""
CHUNK = 8
"""Column blocks per parallel task."""
PANEL = 8
"""3x4 block: weight-row groups computed for one 4-row block of tokens before the next."""
FASTMATH = {"reassoc", "contract"}


def machine_weight_rows() -> int:
    """Weight rows per register block for this CPU: 4 with 32 vector registers (AVX-512),
    else 3 (16 registers: a 4x4 block's 24 live vectors would spill)."""
    import llvmlite.binding as llvm

    return 4 if llvm.get_host_cpu_features().get("avx512f", False) else 3


WEIGHT_ROWS = machine_weight_rows()
"""The register block `Linear` uses by default here (4: 4x4 and 8x2 blocks; 3: 3x4)."""


def padded_rows(m: int) -> int:
    """Rows the buffers of an M-row step hold: 1 or 2 for M <= 2, else M rounded up to a
    multiple of 4. A layer without the 16x1 block computes a 1-row step as 2 rows, one
    without the 8x2 block a 1- or 2-row step as 4, the 4x4 block any step as this many and the
    3x4 block with remainder blocks only the rows asked for past 4 (`Linear.__call__`)."""
    if m <= SMALL_ROWS:
        return max(m, 1)
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
        u0 = widen(w0[k])
        u1 = widen(w1[k])
        u2 = widen(w2[k])
        u3 = widen(w3[k])
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
        u = widen(w0[k])
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


@njit(fastmath=FASTMATH, inline="always")
def _block3(x, m0, w0, w1, w2, out, n0, n1, n2, bias):  # pragma: no cover - compiled
    # x: (Mp, K) f32; w0..w2: (K,) f32 weight rows n0..n2; out: (Mp, N) f32; bias: (N,) f32 or (0,)
    # The dot product of _block4 with 12 accumulators: fits 16 vector registers.
    x0 = x[m0]
    x1 = x[m0 + 1]
    x2 = x[m0 + 2]
    x3 = x[m0 + 3]
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0)
    a20 = a21 = a22 = a23 = np.float32(0)
    for k in range(x.shape[1]):
        u0 = widen(w0[k])
        u1 = widen(w1[k])
        u2 = widen(w2[k])
        p = x0[k]
        a00 += p * u0
        a10 += p * u1
        a20 += p * u2
        p = x1[k]
        a01 += p * u0
        a11 += p * u1
        a21 += p * u2
        p = x2[k]
        a02 += p * u0
        a12 += p * u1
        a22 += p * u2
        p = x3[k]
        a03 += p * u0
        a13 += p * u1
        a23 += p * u2
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


@njit(fastmath=FASTMATH, inline="always")
def _block8x2(x, w, r0, rs, out, c0, cs, bias):  # pragma: no cover - compiled
    # x: (>= 2, K) f32; weight rows r0 + j * rs (j < 8) of w: (N', K) f32 into output columns
    # c0 + j * cs of out: (>= 2, N) f32; bias: (N,) f32 or (0,). Same dot product as _block4.
    x0 = x[0]
    x1 = x[1]
    w0, w1, w2, w3 = w[r0], w[r0 + rs], w[r0 + 2 * rs], w[r0 + 3 * rs]
    w4, w5, w6, w7 = w[r0 + 4 * rs], w[r0 + 5 * rs], w[r0 + 6 * rs], w[r0 + 7 * rs]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0)
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = np.float32(0)
    for k in range(x.shape[1]):
        p = x0[k]
        r = x1[k]
        u = widen(w0[k])
        a0 += p * u
        b0 += r * u
        u = widen(w1[k])
        a1 += p * u
        b1 += r * u
        u = widen(w2[k])
        a2 += p * u
        b2 += r * u
        u = widen(w3[k])
        a3 += p * u
        b3 += r * u
        u = widen(w4[k])
        a4 += p * u
        b4 += r * u
        u = widen(w5[k])
        a5 += p * u
        b5 += r * u
        u = widen(w6[k])
        a6 += p * u
        b6 += r * u
        u = widen(w7[k])
        a7 += p * u
        b7 += r * u
    if bias.shape[0]:
        a0 += bias[c0]
        b0 += bias[c0]
        a1 += bias[c0 + 1 * cs]
        b1 += bias[c0 + 1 * cs]
        a2 += bias[c0 + 2 * cs]
        b2 += bias[c0 + 2 * cs]
        a3 += bias[c0 + 3 * cs]
        b3 += bias[c0 + 3 * cs]
        a4 += bias[c0 + 4 * cs]
        b4 += bias[c0 + 4 * cs]
        a5 += bias[c0 + 5 * cs]
        b5 += bias[c0 + 5 * cs]
        a6 += bias[c0 + 6 * cs]
        b6 += bias[c0 + 6 * cs]
        a7 += bias[c0 + 7 * cs]
        b7 += bias[c0 + 7 * cs]
    out[0, c0] = a0
    out[1, c0] = b0
    out[0, c0 + 1 * cs] = a1
    out[1, c0 + 1 * cs] = b1
    out[0, c0 + 2 * cs] = a2
    out[1, c0 + 2 * cs] = b2
    out[0, c0 + 3 * cs] = a3
    out[1, c0 + 3 * cs] = b3
    out[0, c0 + 4 * cs] = a4
    out[1, c0 + 4 * cs] = b4
    out[0, c0 + 5 * cs] = a5
    out[1, c0 + 5 * cs] = b5
    out[0, c0 + 6 * cs] = a6
    out[1, c0 + 6 * cs] = b6
    out[0, c0 + 7 * cs] = a7
    out[1, c0 + 7 * cs] = b7


@njit(fastmath=FASTMATH, inline="always")
def _block16x1(x0, w, r0, rs, out, c0, cs, bias):  # pragma: no cover - compiled
    # x0: (K,) f32, the step's one row; weight rows r0 + j * rs (j < 16) of w: (N', K) f32 into
    # output columns c0 + j * cs of out: (>= 1, N) f32; bias: (N,) f32 or (0,). Same dot product
    # as _block4: 16 accumulators, so LLVM vectorises each one alike (checked: `one_row_exact`).
    w0, w1, w2, w3 = w[r0], w[r0 + rs], w[r0 + 2 * rs], w[r0 + 3 * rs]
    w4, w5, w6, w7 = w[r0 + 4 * rs], w[r0 + 5 * rs], w[r0 + 6 * rs], w[r0 + 7 * rs]
    w8, w9, w10, w11 = w[r0 + 8 * rs], w[r0 + 9 * rs], w[r0 + 10 * rs], w[r0 + 11 * rs]
    w12, w13, w14, w15 = w[r0 + 12 * rs], w[r0 + 13 * rs], w[r0 + 14 * rs], w[r0 + 15 * rs]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0)
    a8 = a9 = a10 = a11 = a12 = a13 = a14 = a15 = np.float32(0)
    for k in range(x0.shape[0]):
        p = x0[k]
        a0 += p * widen(w0[k])
        a1 += p * widen(w1[k])
        a2 += p * widen(w2[k])
        a3 += p * widen(w3[k])
        a4 += p * widen(w4[k])
        a5 += p * widen(w5[k])
        a6 += p * widen(w6[k])
        a7 += p * widen(w7[k])
        a8 += p * widen(w8[k])
        a9 += p * widen(w9[k])
        a10 += p * widen(w10[k])
        a11 += p * widen(w11[k])
        a12 += p * widen(w12[k])
        a13 += p * widen(w13[k])
        a14 += p * widen(w14[k])
        a15 += p * widen(w15[k])
    if bias.shape[0]:
        a0 += bias[c0]
        a1 += bias[c0 + cs]
        a2 += bias[c0 + 2 * cs]
        a3 += bias[c0 + 3 * cs]
        a4 += bias[c0 + 4 * cs]
        a5 += bias[c0 + 5 * cs]
        a6 += bias[c0 + 6 * cs]
        a7 += bias[c0 + 7 * cs]
        a8 += bias[c0 + 8 * cs]
        a9 += bias[c0 + 9 * cs]
        a10 += bias[c0 + 10 * cs]
        a11 += bias[c0 + 11 * cs]
        a12 += bias[c0 + 12 * cs]
        a13 += bias[c0 + 13 * cs]
        a14 += bias[c0 + 14 * cs]
        a15 += bias[c0 + 15 * cs]
    out[0, c0] = a0
    out[0, c0 + cs] = a1
    out[0, c0 + 2 * cs] = a2
    out[0, c0 + 3 * cs] = a3
    out[0, c0 + 4 * cs] = a4
    out[0, c0 + 5 * cs] = a5
    out[0, c0 + 6 * cs] = a6
    out[0, c0 + 7 * cs] = a7
    out[0, c0 + 8 * cs] = a8
    out[0, c0 + 9 * cs] = a9
    out[0, c0 + 10 * cs] = a10
    out[0, c0 + 11 * cs] = a11
    out[0, c0 + 12 * cs] = a12
    out[0, c0 + 13 * cs] = a13
    out[0, c0 + 14 * cs] = a14
    out[0, c0 + 15 * cs] = a15


@njit(fastmath=FASTMATH, inline="always")
def _block12x1(x, m0, w, c0, ci, cj, out, bias):  # pragma: no cover - compiled
    # Token row m0 of x: (Mp, K) f32 against weight rows n = c0 + i * ci + j * cj (i < 4,
    # j < 3) of w: (N, K) into output columns n of out: (Mp, N) f32; bias: (N,) f32 or (0,).
    # The 3x4 block's dot product with 12 accumulators (`remainder_rows_exact`).
    x0 = x[m0]
    c1, c2 = c0 + cj, c0 + 2 * cj
    n0, n1, n2, n3 = c0, c0 + ci, c0 + 2 * ci, c0 + 3 * ci
    n4, n5, n6, n7 = c1, c1 + ci, c1 + 2 * ci, c1 + 3 * ci
    n8, n9, n10, n11 = c2, c2 + ci, c2 + 2 * ci, c2 + 3 * ci
    w0, w1, w2, w3 = w[n0], w[n1], w[n2], w[n3]
    w4, w5, w6, w7 = w[n4], w[n5], w[n6], w[n7]
    w8, w9, w10, w11 = w[n8], w[n9], w[n10], w[n11]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = a10 = a11 = np.float32(0)
    for k in range(x.shape[1]):
        p = x0[k]
        a0 += p * widen(w0[k])
        a1 += p * widen(w1[k])
        a2 += p * widen(w2[k])
        a3 += p * widen(w3[k])
        a4 += p * widen(w4[k])
        a5 += p * widen(w5[k])
        a6 += p * widen(w6[k])
        a7 += p * widen(w7[k])
        a8 += p * widen(w8[k])
        a9 += p * widen(w9[k])
        a10 += p * widen(w10[k])
        a11 += p * widen(w11[k])
    if bias.shape[0]:
        a0 += bias[n0]
        a1 += bias[n1]
        a2 += bias[n2]
        a3 += bias[n3]
        a4 += bias[n4]
        a5 += bias[n5]
        a6 += bias[n6]
        a7 += bias[n7]
        a8 += bias[n8]
        a9 += bias[n9]
        a10 += bias[n10]
        a11 += bias[n11]
    out[m0, n0] = a0
    out[m0, n1] = a1
    out[m0, n2] = a2
    out[m0, n3] = a3
    out[m0, n4] = a4
    out[m0, n5] = a5
    out[m0, n6] = a6
    out[m0, n7] = a7
    out[m0, n8] = a8
    out[m0, n9] = a9
    out[m0, n10] = a10
    out[m0, n11] = a11


@njit(fastmath=FASTMATH, inline="always")
def _block6x2(x, m0, w, c0, ci, cj, out, bias):  # pragma: no cover - compiled
    # Token rows m0, m0 + 1 of x: (Mp, K) f32 against weight rows n = c0 + i * ci + j * cj
    # (i < 2, j < 3) of w into output columns n of out; as `_block12x1`, 12 accumulators.
    x0 = x[m0]
    x1 = x[m0 + 1]
    c1, c2 = c0 + cj, c0 + 2 * cj
    n0, n1, n2, n3, n4, n5 = c0, c0 + ci, c1, c1 + ci, c2, c2 + ci
    w0, w1, w2, w3, w4, w5 = w[n0], w[n1], w[n2], w[n3], w[n4], w[n5]
    a0 = a1 = a2 = a3 = a4 = a5 = b0 = b1 = b2 = b3 = b4 = b5 = np.float32(0)
    for k in range(x.shape[1]):
        p = x0[k]
        r = x1[k]
        u = widen(w0[k])
        a0 += p * u
        b0 += r * u
        u = widen(w1[k])
        a1 += p * u
        b1 += r * u
        u = widen(w2[k])
        a2 += p * u
        b2 += r * u
        u = widen(w3[k])
        a3 += p * u
        b3 += r * u
        u = widen(w4[k])
        a4 += p * u
        b4 += r * u
        u = widen(w5[k])
        a5 += p * u
        b5 += r * u
    if bias.shape[0]:
        a0 += bias[n0]
        b0 += bias[n0]
        a1 += bias[n1]
        b1 += bias[n1]
        a2 += bias[n2]
        b2 += bias[n2]
        a3 += bias[n3]
        b3 += bias[n3]
        a4 += bias[n4]
        b4 += bias[n4]
        a5 += bias[n5]
        b5 += bias[n5]
    out[m0, n0] = a0
    out[m0 + 1, n0] = b0
    out[m0, n1] = a1
    out[m0 + 1, n1] = b1
    out[m0, n2] = a2
    out[m0 + 1, n2] = b2
    out[m0, n3] = a3
    out[m0 + 1, n3] = b3
    out[m0, n4] = a4
    out[m0 + 1, n4] = b4
    out[m0, n5] = a5
    out[m0 + 1, n5] = b5


@njit(inline="always")
def _split_rows(rows, remainders):  # pragma: no cover - compiled
    # (rows the 3x4 block computes, a multiple of 4; rows left to a remainder block: 0, 1 or 2)
    padded = -(-rows // ROW_BLOCK) * ROW_BLOCK
    rest = rows - (padded - ROW_BLOCK)
    if remainders and rows > ROW_BLOCK and rest <= 2:
        return padded - ROW_BLOCK, rest
    return padded, 0


@njit(fastmath=FASTMATH, inline="always")
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
        _block3(x, m0, w[q], w[q + third], w[q + 2 * third], out, q, q + third, q + 2 * third, bias)
        q += 1


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
def linear4x4(x, w, bias, out, rows):  # pragma: no cover - compiled
    """x: (Mp, K) f32, w: (N, K) as stored (float32, or 16-bit float bits: `widen`), bias:
    (N,) or (0,) f32, out: (Mp, N) f32; the first ``rows`` rows (a multiple of 4, <= Mp) are
    computed."""
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


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
def linear8x2(x, w, bias, out):  # pragma: no cover - compiled
    """`linear4x4` for steps of 1 or 2 rows: x: (>= 2, K) f32, out: (>= 2, N) f32, N a
    multiple of 8; output columns q, q + N/8, ..., q + 7N/8 computed together."""
    eighth = w.shape[0] // SMALL_COL_BLOCK
    tasks = -(-eighth // CHUNK)
    for task in prange(tasks):
        for q in range(task * CHUNK, min(eighth, (task + 1) * CHUNK)):
            _block8x2(x, w, q, eighth, out, q, eighth, bias)


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
def linear16x1(x, w, bias, out):  # pragma: no cover - compiled
    """`linear4x4` for steps of one row: x: (>= 1, K) f32, out: (>= 1, N) f32, N a multiple
    of 16; output columns q, q + N/16, ..., q + 15N/16 computed together."""
    sixteenth = w.shape[0] // ONE_COL_BLOCK
    tasks = -(-sixteenth // CHUNK)
    for task in prange(tasks):
        for q in range(task * CHUNK, min(sixteenth, (task + 1) * CHUNK)):
            _block16x1(x[0], w, q, sixteenth, out, q, sixteenth, bias)


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
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
                _block3(x, m0, w[q], w[q + third], w[q + 2 * third], out, q, q + third, q + 2 * third, bias)
        if rest:
            _remainder(x, w, first, last, third, full, rest, out, bias)
    for n in range(third * 3, w.shape[0]):
        for m0 in range(0, full + (ROW_BLOCK if rest else 0), ROW_BLOCK):
            _block1(x, m0, w[n], out, n, bias)


@njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
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
        _block3(x, 0, w[q], w[q + third], w[q + 2 * third], out, q, q + third, q + 2 * third, bias)
    for n in range(third * 3, w.shape[0]):
        _block1(x, 0, w[n], out, n, bias)


NO_BIAS = np.zeros(0, np.float32)


class Linear:
    """One weight matrix in the model's own storage, ready for the kernels above."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None, *, float16: bool = False,
                 weight_rows: int | None = None):
        # weight: (N, K) float32 (a view of the model's tensor) or 16-bit float bit patterns
        # (bfloat16, or float16 with ``float16``), read as stored (`widen.storage`)
        self.weight_rows = WEIGHT_ROWS if weight_rows is None else weight_rows
        """The register block: 4 (4x4, and 8x2 for 1-2 rows) or 3 (3x4 for every row count)."""
        if self.weight_rows not in (3, 4):
            raise ValueError(f"weight_rows must be 3 or 4, got {self.weight_rows!r}")
        self.weight = storage(weight, float16=float16)
        self.bias = NO_BIAS if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
        self.out_features, self.in_features = weight.shape
        kind = _kind(self.weight)
        self.two_rows = (self.weight_rows == 4 and self.out_features % SMALL_COL_BLOCK == 0
                         and small_rows_exact(self.in_features, kind))
        """Whether 1- and 2-row steps may use the 8x2 block (else they are padded to 4 rows)."""
        self.one_row = (self.two_rows and self.out_features % ONE_COL_BLOCK == 0
                        and one_row_exact(self.in_features, kind))
        """Whether 1-row steps may use the 16x1 block (else they run as 2 rows)."""
        self.few_rows = self.weight_rows == 3 and few_rows_exact(self.in_features, kind)
        """Whether 1- and 2-row steps may use the 6x2 block (`linear3x4_few`; 3x4 path, else
        they run as 4 rows)."""
        self.remainders = self.weight_rows == 3 and remainder_rows_exact(self.in_features, kind)
        """Whether the last 1 or 2 rows of a step past 4 rows may use the 12x1 / 6x2 block (3x4
        block only; else the step is padded to a multiple of 4 rows)."""

    def __call__(self, x: np.ndarray, out: np.ndarray, rows: int) -> np.ndarray:
        """``out[:rows] = x[:rows] @ weight.T + bias`` for ``rows`` >= 1. The kernels compute
        whole blocks of rows: ``x`` and ``out`` need `computed_rows` rows (their content past
        ``rows`` is scratch)."""
        need = self.computed_rows(rows)
        if len(x) < need or len(out) < need:  # the kernels do not check bounds
            raise ValueError(f"this layer computes a {rows}-row step as {need} rows: x and out need as many")
        if rows == 1 and self.one_row:
            linear16x1(x, self.weight, self.bias, out)
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
        """Rows of buffer a ``rows``-row step touches: 1 on the 16x1 block, 2 on the 8x2 block,
        else ``rows`` rounded up to a multiple of 4 (the 3x4 block's remainder blocks and
        `linear3x4_few` compute fewer, in the same buffer)."""
        if rows == 1 and self.one_row:
            return 1
        if rows <= SMALL_ROWS and self.two_rows:
            return SMALL_ROWS
        return -(-rows // ROW_BLOCK) * ROW_BLOCK


def _kind(stored: np.ndarray) -> str:
    """The weight format a stored array holds (`widen.storage`)."""
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
def one_row_exact(in_features: int, kind: str = "float32") -> bool:
    """Whether the 16x1 block gives, bit for bit, row 0 of what the 4x4 block gives (see
    `small_rows_exact`)."""
    stored, bias, x = _sample(in_features, 2 * ONE_COL_BLOCK, kind)
    one = np.zeros((1, len(stored)), np.float32)
    linear16x1(x, stored, bias, one)
    return _four_rows(x, stored, bias)[0].tobytes() == one[0].tobytes()


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
    of length ``in_features`` on this machine (``kind``: the weights' dtype name), checked on
    random numbers. Both compile to the same arithmetic where LLVM vectorises both loops alike;
    this is the check that they did, so the 2-row block can never change a result."""
    stored, bias, x = _sample(in_features, 2 * SMALL_COL_BLOCK, kind)
    two = np.zeros((SMALL_ROWS, len(stored)), np.float32)
    linear8x2(x, stored, bias, two)
    return _four_rows(x, stored, bias)[:SMALL_ROWS].tobytes() == two.tobytes()


@functools.cache
def remainder_rows_exact(in_features: int, kind: str = "float32") -> bool:
    """Whether the 12x1 and 6x2 blocks give, bit for bit, what the 3x4 block gives for dot
    products of length ``in_features`` on this machine (see `small_rows_exact`): steps of 5
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
