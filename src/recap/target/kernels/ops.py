"""The small per-row operations of a decoder step, and tree attention.

Each works on one row (or one (row, head) pair) at a time with a fixed order of operations,
so a row's result never depends on the other rows of the step. Only dot products over a
contiguous vector may be vectorised (``fastmath`` reassociation inside `_dot`, one
compiled loop for every call); softmax, RoPE and SiLU keep IEEE order, and their ``exp`` is
`exp32`, which vectorises. ``error_model="numpy"`` lets divisions vectorise too (a float
division by zero gives inf instead of raising, which none of these can meet anyway).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from recap.target.kernels.exp import exp32

FASTMATH = {"reassoc", "contract"}


@njit(fastmath=FASTMATH, cache=True)
def _dot(a, b):  # pragma: no cover - compiled
    # a, b: (D,) f32 -> f32
    s = np.float32(0)
    for d in range(a.shape[0]):
        s += a[d] * b[d]
    return s


@njit(fastmath=FASTMATH, cache=True)
def _sum_squares(a):  # pragma: no cover - compiled
    s = np.float32(0)
    for d in range(a.shape[0]):
        s += a[d] * a[d]
    return s


@njit(cache=True, nogil=True)
def rms_norm(x, weight, eps, out, rows):  # pragma: no cover - compiled
    """out[i] = weight * x[i] / sqrt(mean(x[i]^2) + eps) for i < rows. x, out: (Mp, C) f32."""
    width = x.shape[1]
    for i in range(rows):
        scale = np.float32(1.0) / np.sqrt(_sum_squares(x[i]) / np.float32(width) + np.float32(eps))
        for c in range(width):
            out[i, c] = weight[c] * (x[i, c] * scale)


@njit(cache=True, nogil=True)
def rope(x, heads, cos, sin, rows):  # pragma: no cover - compiled
    """Rotary embedding in place, Hugging Face's rotate-half layout: x[i] viewed as
    (heads, D); cos, sin: (M, D), row i's angles (gathered from the position tables)."""
    dim = cos.shape[1]
    half = dim // 2
    for i in range(rows):
        c = cos[i]
        s = sin[i]
        for h in range(heads):
            base = h * dim
            for d in range(half):
                lo = x[i, base + d]
                hi = x[i, base + half + d]
                x[i, base + d] = lo * c[d] + (-hi) * s[d]
                x[i, base + half + d] = hi * c[half + d] + lo * s[half + d]


@njit(cache=True, nogil=True, error_model="numpy")
def silu_mul(gate, up, rows):  # pragma: no cover - compiled
    """gate[i] = silu(gate[i]) * up[i] in place, silu(g) = g / (1 + exp(-g))."""
    for i in range(rows):
        for c in range(gate.shape[1]):
            g = gate[i, c]
            gate[i, c] = g / (np.float32(1.0) + exp32(-g)) * up[i, c]


@njit(cache=True, nogil=True)
def write_cache(kv, cache, start, heads, rows):  # pragma: no cover - compiled
    """cache[h, start + i] = kv[i] viewed as (heads, D), for i < rows; cache: (H_kv, S, D)."""
    dim = cache.shape[2]
    for i in range(rows):
        for h in range(heads):
            cache[h, start + i, :] = kv[i, h * dim : (h + 1) * dim]


@njit(cache=True, nogil=True)
def _key_slot(j, past, ancestors, first):  # pragma: no cover - compiled
    # Key j of a node: the cached prefix first, then its ancestors (root first) and itself,
    # whose K/V this step wrote at slot past + packed index.
    if j < past:
        return j
    return past + ancestors[first + j - past]


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def tree_attention(q, keys, values, past, starts, ancestors, scale, out, rows):  # pragma: no cover - compiled
    """Each packed node attends to the cached prefix and to its own path, in position order.

    q, out: (Mp, H*D) f32; keys, values: (H_kv, S, D) f32, the step's rows already written at
    slots past..past+rows-1; starts: (rows+1,) int64 and ancestors: the node's path as packed
    indices (root first, the node last) in ancestors[starts[i]:starts[i+1]]. A node at depth
    d thus sees exactly the past + d + 1 keys a plain one-token step at its position sees,
    in the same order: its output is that step's, bit for bit."""
    kv_heads, _, dim = keys.shape
    heads = q.shape[1] // dim
    groups = heads // kv_heads
    for task in prange(rows * heads):
        # kv head first: the (row, query head) pairs reading one kv head's keys and values
        # run back to back while those are in cache (the order changes no arithmetic)
        g = task // (rows * groups)
        i = task % (rows * groups) // groups
        h = g * groups + task % groups
        first = starts[i]
        length = past + starts[i + 1] - first
        query = q[i, h * dim : (h + 1) * dim]
        scores = np.empty(length, np.float32)
        top = -np.inf
        for j in range(length):
            s = _dot(query, keys[g, _key_slot(j, past, ancestors, first)]) * np.float32(scale)
            scores[j] = s
            top = max(top, s)
        peak = np.float32(top)
        for j in range(length):  # vectorised
            scores[j] = exp32(scores[j] - peak)
        total = np.float32(0)
        for j in range(length):  # in key order, as a plain step sums them
            total += scores[j]
        acc = np.zeros(dim, np.float32)
        for j in range(length):
            p = scores[j] / total
            v = values[g, _key_slot(j, past, ancestors, first)]
            for d in range(dim):
                acc[d] += p * v[d]
        out[i, h * dim : (h + 1) * dim] = acc
