"""The small per-row operations of a decoder step, and tree attention.

Each works on one row (or one (row, head) pair) at a time with a fixed order of operations,
so a row's result never depends on the other rows of the step, the machine or the thread
count. Dot products and sums run in `lanes` order (a fixed number of partial sums, fused
multiply-adds, a fixed final tree: no ``fastmath`` reassociation anywhere); softmax, RoPE and
SiLU keep IEEE order element by element (vectorised across elements, which reorders
nothing), and their ``exp`` is `exp32`, which vectorises. ``error_model="numpy"`` lets
divisions vectorise too (a float division by zero gives inf instead of raising, which none
of these can meet anyway).
"""

from __future__ import annotations

import functools
from collections import namedtuple

import numpy as np
from numba import njit, prange

from recap.verifier.kernels import lanes
from recap.verifier.kernels.exp import exp32
from recap.verifier.kernels.lanes import LANES
from recap.verifier.kernels.linear import NO_BIAS, KernelDefect, _block3

KEY_BLOCK = 3
"""Keys scored together by `_quad_scores` (the 3x4 block of the linear layers: 3 keys x 4
queries), at positions 3b, 3b + 1, 3b + 2 of every query's key sequence."""


@njit(cache=True, nogil=True)
def rms_norm(x, weight, eps, out, rows):  # pragma: no cover - compiled
    """out[i] = weight * x[i] / sqrt(mean(x[i]^2) + eps) for i < rows. x, out: (Mp, C) f32."""
    width = x.shape[1]
    for i in range(rows):
        scale = np.float32(1.0) / np.sqrt(lanes.dot(x[i], x[i]) / np.float32(width) + np.float32(eps))
        for c in range(width):
            out[i, c] = weight[c] * (x[i, c] * scale)


@njit(cache=True, nogil=True)
def add_rms_norm(h, o, weight, eps, out, rows):  # pragma: no cover - compiled
    """The residual add ``h[i] += o[i]`` (one float32 addition an element, as numpy's), then
    `rms_norm` of h into out, for i < rows: one call where a layer made two (numpy's add on
    row slices cost as much to call as the norm)."""
    for i in range(rows):
        for c in range(h.shape[1]):
            h[i, c] += o[i, c]
    rms_norm(h, weight, eps, out, rows)


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


GELU_C0 = np.float32(0.7978845608028654)
"""sqrt(2 / pi), GeLU's tanh approximation."""
GELU_C1 = np.float32(0.044715)


@njit(cache=True, nogil=True, error_model="numpy")
def gelu_tanh_mul(gate, up, rows):  # pragma: no cover - compiled
    """gate[i] = gelu_tanh(gate[i]) * up[i] in place (Gemma's MLP), gelu_tanh(g) = g / 2 *
    (1 + tanh(y)) with y = sqrt(2/pi) (g + 0.044715 g^3), written as g / (1 + exp(-2y)):
    the same function (1 + tanh(y) = 2 / (1 + exp(-2y))), on `exp32`, so it vectorises."""
    for i in range(rows):
        for c in range(gate.shape[1]):
            g = gate[i, c]
            y = GELU_C0 * (g + GELU_C1 * (g * g * g))
            gate[i, c] = g / (np.float32(1.0) + exp32(-(y + y))) * up[i, c]


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


@njit(inline="always", cache=True)
def first_key(length, window):  # pragma: no cover - compiled
    """The first of a query's ``length`` keys (in position order) that it attends to: 0, or
    with a sliding ``window`` (> 0) the last ``window`` only, as Hugging Face's sliding mask
    (``key > query - window``)."""
    if window > 0 and length > window:
        return length - window
    return 0


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def tree_attention(q, keys, values, past, starts, ancestors, scale, window, out, rows):  # pragma: no cover - compiled
    """Each packed node attends to the cached prefix and to its own path, in position order.

    q, out: (Mp, H*D) f32; keys, values: (H_kv, S, D) f32, the step's rows already written at
    slots past..past+rows-1; starts: (rows+1,) int64 and ancestors: the node's path as packed
    indices (root first, the node last) in ancestors[starts[i]:starts[i+1]]. A node at depth
    d thus sees exactly the past + d + 1 keys a plain one-token step at its position sees,
    in the same order: its output is that step's, bit for bit. ``window`` > 0 (a sliding
    layer): of those, the last ``window`` (`first_key`), which are again the plain step's;
    its softmax and sums start at its first key, as the plain step's do."""
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
        low = first_key(length, window)
        query = q[i, h * dim : (h + 1) * dim]
        scores = np.empty(length, np.float32)
        top = -np.inf
        for j in range(low, length):
            s = lanes.dot(query, keys[g, _key_slot(j, past, ancestors, first)]) * np.float32(scale)
            scores[j] = s
            top = max(top, s)
        peak = np.float32(top)
        kept = scores[low:length]  # indexed from 0, so the loop vectorises (`_softmax`)
        for j in range(kept.shape[0]):
            kept[j] = exp32(kept[j] - peak)
        total = np.float32(0)
        for j in range(low, length):  # in key order, as a plain step sums them
            total += scores[j]
        acc = np.zeros(dim, np.float32)
        for j in range(low, length):
            p = scores[j] / total
            v = values[g, _key_slot(j, past, ancestors, first)]
            for d in range(dim):
                acc[d] += p * v[d]
        out[i, h * dim : (h + 1) * dim] = acc


@njit(cache=True, nogil=True)
def _sum32(a):  # pragma: no cover - compiled
    # a: (L,) f32 -> its sum in `lanes` order (lane j % LANES holds a[j], added in order of
    # j; then the fixed tree): the softmax total of quad attention
    acc = lanes.zeros()
    length = a.shape[0]
    full = lanes.whole(length)
    for j in range(0, full, LANES):
        acc = lanes.add(acc, lanes.load(a, j))
    for j in range(full, length):
        acc = lanes.with_lane(acc, j - full, lanes.lane(acc, j - full) + a[j])
    return lanes.total(acc)


@njit(fastmath={"nnan", "nsz"}, cache=True, nogil=True)
def _max32(a):  # pragma: no cover - compiled
    # a: (L >= 1,) f32 -> its maximum: the same value in any order (vectorised on finite
    # scores; only a zero's sign could follow the order, and exp32(s - peak) cannot see it)
    top = a[0]
    for j in range(1, a.shape[0]):
        top = max(top, a[j])
    return top


@njit(inline="always", error_model="numpy")
def _softmax(kept, scale):  # pragma: no cover - compiled
    # In place: a query's scores on the keys it attends to -> its attention weights: each
    # scaled, less their maximum, `exp32`, divided by their `_sum32` total. ``kept`` is the
    # slice from the first such key, so every loop indexes it from 0: numba then knows no
    # index is negative and LLVM vectorises them (from a variable first key, as with sliding
    # windows, each index went through numba's negative-index wraparound and they ran
    # element by element, 4x slower). The operations are the same either way.
    for j in range(kept.shape[0]):
        kept[j] = kept[j] * np.float32(scale)
    peak = _max32(kept)
    for j in range(kept.shape[0]):
        kept[j] = exp32(kept[j] - peak)
    total = _sum32(kept)
    for j in range(kept.shape[0]):
        kept[j] = kept[j] / total


@njit(cache=True, nogil=True)
def _quad_scores(queries, keys, past, lengths, firsts, ancestors, units, b, scores,
                 window):  # pragma: no cover - compiled
    """``scores[u, j] = queries[u] . (key j of query u)``, unscaled, for the 4 queries u of
    quad ``b`` and `first_key` <= j < lengths[u] (the shared loop may also fill some below a
    query's first key, which the caller ignores). queries: (Up, D) f32, one kv head's query
    vectors; keys: (S, D) f32, its cache; scores: (Up, >= max length) f32.

    Each score is one dot product of `_block3`, the linear layers' 3x4 block (3 keys x 4
    queries), key j always in lane j % 3 of the block of keys 3 * (j // 3). The cached
    prefix's full blocks are the same keys for all 4 queries (each key row read once for
    them); the rest (the prefix's last partial block, the query's own path) run per query
    on its own keys, the other slots idle. Key j's score is thus the same in a tree as in
    the one-token step at the node's position (where key j may be a cached one, computed
    by the shared loop): the block computes each of its 12 dot products in `lanes` order, so
    a query gets the same bits in each of its 4 slots and in both loops (`block_slots_exact`
    asserts it)."""
    shared = past - past % KEY_BLOCK
    lowest = past
    for u in range(4 * b, min(4 * b + 4, units)):
        lowest = min(lowest, first_key(lengths[u], window))
    for j in range(lowest - lowest % KEY_BLOCK, shared, KEY_BLOCK):
        _block3(queries, 4 * b, keys, (j, j + 1, j + 2), scores, (j, j + 1, j + 2), NO_BIAS)
    block = np.empty((4, KEY_BLOCK), np.float32)
    quad = queries[4 * b:4 * b + 4]
    for u in range(4 * b, min(4 * b + 4, units)):
        length, first, m = lengths[u], firsts[u], u - 4 * b
        low = first_key(length, window)
        for j in range(max(shared, low - low % KEY_BLOCK), length, KEY_BLOCK):
            s0 = _key_slot(j, past, ancestors, first)
            s1 = _key_slot(j + 1, past, ancestors, first) if j + 1 < length else s0
            s2 = _key_slot(j + 2, past, ancestors, first) if j + 2 < length else s0
            _block3(quad, 0, keys, (s0, s1, s2), block, (0, 1, 2), NO_BIAS)
            for lane in range(min(KEY_BLOCK, length - j)):
                scores[u, j + lane] = block[m, lane]


QuadPlan = namedtuple("QuadPlan", "past rows lengths firsts queries scores acc")
"""One request's step for `quad_attention` (`QuadAttention.plan`): the same for every layer."""


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def quad_attention(plan, q, keys, values, ancestors, scale, window, out):  # pragma: no cover - compiled
    """`tree_attention` (q, keys, values, ancestors, scale, out as there) four queries of one
    kv head at a time, one parallel task per quad: query head h of row i is query u = i * G +
    h % G of kv head h // G (G query heads per kv head). Per quad: its queries gathered, dot
    products by `_quad_scores`, then per query a softmax (scale, max, `exp32`, the total by
    `_sum32`, a vectorised sum whose order depends on the query's key count alone, p = e /
    total) and the weighted sum of V as `tree_attention` forms it (each element ``acc[d] +=
    p * v[d]`` in key order, IEEE), the cached prefix's V rows read once for the 4 queries;
    the results go to ``out``.

    ``window`` > 0 (a sliding layer): each query attends to its last ``window`` keys
    (`first_key`), its softmax over those alone, as its plain step's; below its first key
    its weights are 0, so the V rows shared with the quad's other queries add nothing to it
    (+0 + w * v stays +0 for w = 0, and its own sum then starts where the plain step's does).

    ``plan`` (a `QuadPlan`): past and rows as `tree_attention`'s; lengths, firsts: (Up,)
    int64, query u's key count (past + depth + 1, 0 for padding) and path start in
    ``ancestors``; queries, acc: (H_kv, Up, D) f32 and scores: (H_kv, Up, >= max length) f32,
    scratch (Up: the queries rounded up to a multiple of 4)."""
    past, rows, lengths, firsts, queries, scores, acc = plan
    kv_heads, up, dim = queries.shape
    groups = q.shape[1] // dim // kv_heads
    units = rows * groups
    quads = up // 4
    for task in prange(kv_heads * quads):
        g = task // quads
        b = task % quads
        for u in range(4 * b, 4 * b + 4):
            if u < units:
                h = g * groups + u % groups
                queries[g, u, :] = q[u // groups, h * dim:(h + 1) * dim]
            else:
                queries[g, u, :] = 0
        probs = scores[g]
        _quad_scores(queries[g], keys[g], past, lengths, firsts, ancestors, units, b, probs, window)
        lowest = past  # the first cached key any of the quad's queries attends to
        for u in range(4 * b, min(4 * b + 4, units)):
            lowest = min(lowest, first_key(lengths[u], window))
        for u in range(4 * b, 4 * b + 4):
            row = probs[u]
            if u >= units:  # a padding slot: weight 0 on the shared keys
                row[lowest:past] = 0
                continue
            length = lengths[u]
            low = first_key(length, window)
            row[lowest:low] = 0
            _softmax(row[low:length], scale)
        a0, a1, a2, a3 = acc[g, 4 * b], acc[g, 4 * b + 1], acc[g, 4 * b + 2], acc[g, 4 * b + 3]
        p0, p1, p2, p3 = probs[4 * b], probs[4 * b + 1], probs[4 * b + 2], probs[4 * b + 3]
        a0[:] = 0
        a1[:] = 0
        a2[:] = 0
        a3[:] = 0
        for j in range(lowest, past - (past - lowest) % 2, 2):  # two keys per pass: half the loads and stores of acc
            v, y = values[g, j], values[g, j + 1]
            w0, w1, w2, w3 = p0[j], p1[j], p2[j], p3[j]
            z0, z1, z2, z3 = p0[j + 1], p1[j + 1], p2[j + 1], p3[j + 1]
            for d in range(dim):  # vectorised over d; each element's sum stays in key order
                x, t = v[d], y[d]
                a0[d] = (a0[d] + w0 * x) + z0 * t
                a1[d] = (a1[d] + w1 * x) + z1 * t
                a2[d] = (a2[d] + w2 * x) + z2 * t
                a3[d] = (a3[d] + w3 * x) + z3 * t
        if (past - lowest) % 2:
            v = values[g, past - 1]
            w0, w1, w2, w3 = p0[past - 1], p1[past - 1], p2[past - 1], p3[past - 1]
            for d in range(dim):
                x = v[d]
                a0[d] += w0 * x
                a1[d] += w1 * x
                a2[d] += w2 * x
                a3[d] += w3 * x
        for u in range(4 * b, min(4 * b + 4, units)):
            a, row, first = acc[g, u], probs[u], firsts[u]
            for j in range(max(past, first_key(lengths[u], window)), lengths[u]):
                w = row[j]
                v = values[g, _key_slot(j, past, ancestors, first)]
                for d in range(dim):
                    a[d] += w * v[d]
            h = g * groups + u % groups
            out[u // groups, h * dim:(h + 1) * dim] = a


class QuadAttention:
    """Attention by `quad_attention`, for models with at least `MIN_GROUPS` query heads per kv
    head (a one-token step then fills most of a quad's slots; with fewer, the idle slots
    cost more than sharing saves). Whether it is used depends on the model only, never on a
    step's row count or the machine, so a tree and a plain step always share arithmetic. A
    step first makes one `plan` per request (the queries' key counts, scratch views); every
    layer then runs on it."""

    MIN_GROUPS = 3

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        if not block_slots_exact(head_dim):
            raise KernelDefect(f"quad attention gives a query other bits in another slot (head size {head_dim}): "
                               "its score block no longer follows `lanes` order")
        self.groups, self.kv_heads, self.head_dim = heads // kv_heads, kv_heads, head_dim
        self._memory = np.zeros(0, np.float32)

    @classmethod
    def suits(cls, heads: int, kv_heads: int, head_dim: int) -> bool:
        return heads // kv_heads >= cls.MIN_GROUPS

    def plan(self, past: int, starts: np.ndarray, rows: int) -> QuadPlan:
        """For a step of ``rows`` packed nodes after ``past`` cached tokens (``starts`` as
        `tree_attention`'s): lengths, firsts and C-contiguous scratch views (numba compiles
        strided views apart, and slower), carved from a buffer that only grows (to 1.25x the
        largest step's need: about 12 MB for a 64-row prompt chunk at 4,096 cached tokens on
        SmolLM2). The requests of a batched step run one after another, so their plans may
        share it."""
        units = rows * self.groups
        up = -(-units // 4) * 4
        row_of = np.minimum(np.arange(up) // self.groups, rows - 1)
        firsts = np.ascontiguousarray(starts[row_of], dtype=np.int64)
        lengths = past + starts[row_of + 1] - firsts
        lengths[units:] = 0
        kv, dim, width = self.kv_heads, self.head_dim, int(lengths.max()) + KEY_BLOCK
        sizes = (kv * up * dim, kv * up * dim, kv * up * width)
        if len(self._memory) < sum(sizes):  # a quarter to spare: contexts grow a few rows a step
            self._memory = np.zeros(sum(sizes) + sum(sizes) // 4, np.float32)
        a, b = sizes[0], sizes[0] + sizes[1]
        return QuadPlan(past, rows, lengths, firsts, self._memory[:a].reshape(kv, up, dim),
                        self._memory[b:b + sizes[2]].reshape(kv, up, width), self._memory[a:b].reshape(kv, up, dim))

    def __call__(self, plan: QuadPlan, q, keys, values, ancestors, scale: float, out, window: int = 0) -> None:
        """`tree_attention` of the planned step (q, keys, values, ancestors, scale, window, out as there)."""
        quad_attention(plan, q, keys, values, ancestors, scale, window, out)


@functools.cache
def block_slots_exact(head_dim: int) -> bool:
    """Whether `_quad_scores` gives a query the same bits in each of its 4 slots, and in its
    shared loop as in its per-query loop, for dot products of length ``head_dim`` (random
    numbers). Both loops inline the same block in `lanes` order, so this holds by
    construction; `QuadAttention` asserts it, so an edited block is refused, not used."""
    rng = np.random.default_rng(head_dim)
    x = rng.standard_normal((4, head_dim), dtype=np.float32)
    keys = rng.standard_normal((2 * KEY_BLOCK, head_dim), dtype=np.float32)
    length, reference = 2 * KEY_BLOCK, None
    for past in (length, 0):  # every key in the shared loop, then every key on each query's own path
        path, lengths, firsts = np.arange(length, dtype=np.int64), np.full(4, length, np.int64), np.zeros(4, np.int64)
        for shift in range(4):
            got = np.zeros((4, length), np.float32)
            _quad_scores(np.ascontiguousarray(np.roll(x, shift, axis=0)), keys, past, lengths, firsts, path, 4, 0, got,
                         0)
            back = np.roll(got, -shift, axis=0)
            if reference is None:
                reference = back
            elif back.tobytes() != reference.tobytes():
                return False
    return True
