"""RECAP's host work, compiled with numba: the U/C/G prediction memory, fusion and the
best-first tree search. This is RECAP's only engine.

The readable pure-Python version of the same method lives in ``tests/reference_recap.py`` as
the tests' oracle; ``tests/test_fast.py`` checks differentially that this engine computes the
same memory (``seed_from_prompt``, ``refresh``), the same fusion in every mode and the same
trees (lookup, fusion, excluded tokens dropped without renormalising, cut to ``width``,
best-first heap with lazy siblings and the counter tie-break, depth priors, budget, maximum
depth), bit for bit.

A *row* is the target's Top-K at one evaluated position: token ids (highest first), their
probabilities renormalised over the K kept logits, and the confidence exp(-entropy) that
fusion needs. U (1-token keys) persists across the requests of a stream; C (2-token) and G
(3-token) are request-local. Each key keeps its most recently written row; within one
verification batch the first occurrence of a key wins.

Storage: a row pool (``ids`` int64 [R, K], ``probs`` float64 [R, K], ``confidence`` float64
[R], ``length`` int64 [R]) and three numba typed dicts mapping an int64 key to a pool row:
U key ``x``, C key ``v * V + x``, G key ``(u * V + v) * V + x`` (V = vocabulary size). Rows
whose keys were all overwritten stay in the pool as garbage until ``reset_request`` compacts
the pool (in place) to the rows U still references; within a request the pool doubles when
full, so it holds at most U's rows at the request start plus one row per position the
request evaluated (the order of C and G's own growth). A compaction that leaves the pool
less than a quarter full shrinks it to twice the live rows (at least 256), so a stream that
lives as long as a server gives back what a long request or an eviction freed.

Softmax and confidence of new rows are computed with numpy expressions fixed here (the
reference uses the same ones, hence the same bits); every floating-point operation of fusion
and of the tree search is done in the reference's order (Python's ``sum`` included: naive
before 3.12, Neumaier-compensated from 3.12 on).

Each of ``build_tree``, ``refresh`` and ``seed_from_prompt`` is one compiled call. Contexts
are ``(u, v, x)`` with -1 for a token before the start of the history (`context_of`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import numpy as np
from numba import njit, types
from numba.typed import Dict

from recap.core.steps import first_eligible, rows_at

FUSION_CODES = {"entropy": 0, "no-confidence": 1, "no-prior": 2, "uniform": 3, "gate": 4, "backoff": 5,
                "unigram": 6}
"""Fusion mode -> integer code for `FastMemory.build_tree`."""
FUSION_MODES = tuple(FUSION_CODES)
"""Entropy-confidence fusion of the rows retrieved for one context (most specific first):
row j gets the prior of its rank among the available rows times its confidence, weights are
normalised, the mixture is cut to its K largest entries and renormalised. ``entropy`` is
RECAP; ``no-confidence``: confidences 1; ``no-prior``: priors 1; ``uniform``: both;
``gate``: the most confident row alone (ties: the more specific); ``backoff``: the most
specific row alone; ``unigram``: U alone."""
PRIORS = (0.70, 0.20, 0.10)
"""Rank priors of the available rows (most specific first)."""

_ENTROPY, _NO_CONFIDENCE, _NO_PRIOR, _UNIFORM, _GATE, _BACKOFF, _UNIGRAM = range(7)
_COMPENSATED_SUM = sys.version_info >= (3, 12)
"""CPython's builtin ``sum`` over floats is Neumaier-compensated from 3.12 on (gh-100425)."""
_MAX_VOCAB = 2_097_151  # V**3 must fit an int64 G key
_MIN_ROWS = 256
_NO_EXCLUSION = np.zeros(0, dtype=np.bool_)


def context_of(history: Sequence[int]) -> tuple[int, int, int]:
    """(u, v, x): the last three tokens of ``history``, -1 before its start."""
    padded = [-1, -1, *history[-3:]]
    return int(padded[-3]), int(padded[-2]), int(padded[-1])


def fusion_code(mode: int | str) -> int:
    if isinstance(mode, str):
        try:
            return FUSION_CODES[mode]
        except KeyError:
            raise ValueError(f"unknown fusion mode {mode!r}; choose one of: {', '.join(FUSION_CODES)}") from None
    code = int(mode)
    if not 0 <= code < len(FUSION_CODES):
        raise ValueError(f"unknown fusion mode code {code}")
    return code


def _softmax_rows(topk_logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Probabilities and confidences of new rows: softmax over the K kept logits,
    confidence exp(-entropy) (the reference's ``rows_from_logits``: same expressions, same bits)."""
    logits = np.asarray(topk_logits, dtype=np.float64)
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = shifted / shifted.sum(axis=1, keepdims=True)
    if probs.min() > 0:  # the common case: np.where would select every product (same values, no warnings)
        entropy = -(probs * np.log(probs)).sum(axis=1)
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            entropy = -np.where(probs > 0, probs * np.log(probs), 0.0).sum(axis=1)
    confidence = np.exp(-entropy)
    return probs, confidence


def _new_map():
    return Dict.empty(key_type=types.int64, value_type=types.int64)


# ============================================================================ compiled kernels
@njit(cache=True)
def _pysum(values, start, stop):
    """``sum(values[start:stop])`` as CPython computes it over floats (start value int 0)."""
    if stop <= start:
        return 0.0
    total = 0.0 + values[start]
    if not _COMPENSATED_SUM:
        for i in range(start + 1, stop):
            total += values[i]
        return total
    c = 0.0
    for i in range(start + 1, stop):
        x = values[i]
        t = total + x
        if abs(total) >= abs(x):
            c += (total - t) + x
        else:
            c += (x - t) + total
        total = t
    if c != 0.0 and math.isfinite(c):
        total += c
    return total


@njit(cache=True)
def _store_row(pool_ids, pool_probs, pool_conf, pool_len, slot, ids, probs, conf, r):
    width = ids.shape[1]
    for j in range(width):
        pool_ids[slot, j] = ids[r, j]
        pool_probs[slot, j] = probs[r, j]
    pool_len[slot] = width
    pool_conf[slot] = conf[r]


@njit(cache=True)
def _refresh(unigram, bigram, trigram, pool_ids, pool_probs, pool_conf, pool_len, n_rows, vocab,
             u0, v0, x0, tree_tokens, tree_parents, ids, probs, conf, contextual):
    """FastMemory.refresh. Returns the new row count, or -1 (nothing written) when a
    key token is outside [0, vocab) or a parent is not an earlier node."""
    n = tree_tokens.shape[0] + 1
    if x0 < 0 or x0 >= vocab or v0 >= vocab or u0 >= vocab:
        return -1
    tok = np.empty(n, np.int64)
    prev1 = np.empty(n, np.int64)
    prev2 = np.empty(n, np.int64)
    tok[0] = x0
    prev1[0] = v0 if v0 >= 0 else -1
    prev2[0] = u0 if (u0 >= 0 and v0 >= 0) else -1
    for i in range(n - 1):
        t = tree_tokens[i]
        parent = tree_parents[i]
        if t < 0 or t >= vocab or parent < -1 or parent >= i:
            return -1
        tok[i + 1] = t
        prev1[i + 1] = tok[parent + 1]
        prev2[i + 1] = prev1[parent + 1]
    # Forward over the batch; a key already pointing at a row of this batch (index >= start)
    # was written by an earlier position: first occurrence wins, as in the reference.
    start = n_rows
    for p in range(n):
        x = tok[p]
        v = prev1[p]
        u = prev2[p]
        slot = -1
        if unigram.get(x, -1) < start:
            slot = n_rows
            _store_row(pool_ids, pool_probs, pool_conf, pool_len, slot, ids, probs, conf, p)
            n_rows += 1
            unigram[x] = slot
        if contextual and v >= 0:
            key = v * vocab + x
            if bigram.get(key, -1) < start:
                if slot < 0:
                    slot = n_rows
                    _store_row(pool_ids, pool_probs, pool_conf, pool_len, slot, ids, probs, conf, p)
                    n_rows += 1
                bigram[key] = slot
            if u >= 0:
                key = (u * vocab + v) * vocab + x
                if trigram.get(key, -1) < start:
                    if slot < 0:
                        slot = n_rows
                        _store_row(pool_ids, pool_probs, pool_conf, pool_len, slot, ids, probs, conf, p)
                        n_rows += 1
                    trigram[key] = slot
    return n_rows


@njit(cache=True)
def _store_unigram(unigram, pool_ids, pool_probs, pool_conf, pool_len, n_rows, vocab, keys, ids, probs, conf):
    """U[keys[i]] <- row i (later rows win). -1 when a key is outside [0, vocab)."""
    for i in range(keys.shape[0]):
        if keys[i] < 0 or keys[i] >= vocab:
            return -1
    for i in range(keys.shape[0]):
        _store_row(pool_ids, pool_probs, pool_conf, pool_len, n_rows, ids, probs, conf, i)
        unigram[keys[i]] = n_rows
        n_rows += 1
    return n_rows


@njit(cache=True)
def _mark(table, used):
    for value in table.values():
        used[value] = True


@njit(cache=True)
def _keys_of(table):
    keys = np.empty(len(table), np.int64)
    for i, key in enumerate(table):
        keys[i] = key
    return keys


@njit(cache=True)
def _remap(table, new_index):
    for key in _keys_of(table):
        table[key] = new_index[table[key]]


@njit(cache=True)
def _compact(unigram, bigram, trigram, pool_ids, pool_probs, pool_conf, pool_len, n_rows):
    """Move the referenced rows to the front of the pool, in order (in place). Returns their count."""
    used = np.zeros(n_rows, np.bool_)
    _mark(unigram, used)
    _mark(bigram, used)
    _mark(trigram, used)
    new_index = np.empty(n_rows, np.int64)
    live = 0
    for r in range(n_rows):
        if used[r]:
            new_index[r] = live
            if live != r:
                pool_ids[live] = pool_ids[r]
                pool_probs[live] = pool_probs[r]
                pool_conf[live] = pool_conf[r]
                pool_len[live] = pool_len[r]
            live += 1
        else:
            new_index[r] = -1
    if live != n_rows:
        _remap(unigram, new_index)
        _remap(bigram, new_index)
        _remap(trigram, new_index)
    return live


@njit(cache=True)
def _unigram_arrays(unigram, pool_ids, pool_probs, pool_len):
    n = len(unigram)
    keys = _keys_of(unigram)
    keys.sort()
    width = 0
    for i in range(n):
        width = max(width, pool_len[unigram[keys[i]]])
    ids = np.zeros((n, width), np.int64)
    probs = np.zeros((n, width), np.float64)
    for i in range(n):
        r = unigram[keys[i]]
        for j in range(pool_len[r]):
            ids[i, j] = pool_ids[r, j]
            probs[i, j] = pool_probs[r, j]
    return keys, ids, probs


@njit(cache=True)
def _row_of(table, pool_ids, pool_probs, pool_conf, pool_len, key):
    r = table[key]
    return pool_ids[r, : pool_len[r]].copy(), pool_probs[r, : pool_len[r]].copy(), pool_conf[r]


@njit(cache=True)
def _fuse(unigram, bigram, trigram, pool_ids, pool_probs, pool_conf, pool_len, vocab, u, v, x, k, width, mode,
          priors, excluded, rows, weights, mix_tok, mix_p, out_tok, out_p, slot):
    """Lookup + fusion for context (u, v, x) (the reference's ``ReferenceSearch.fused``),
    written to out_tok[slot, 1:] (count in out_tok[slot, 0]) and out_p[slot]. Returns the count."""
    # ---- lookup: G, C, U (most specific first), or U alone for mode "unigram"
    n_rows = 0
    if mode != _UNIGRAM:
        if u >= 0 and v >= 0:
            r = trigram.get((u * vocab + v) * vocab + x, -1)
            if r >= 0:
                rows[n_rows] = r
                n_rows += 1
        if v >= 0:
            r = bigram.get(v * vocab + x, -1)
            if r >= 0:
                rows[n_rows] = r
                n_rows += 1
    r = unigram.get(x, -1)
    if r >= 0:
        rows[n_rows] = r
        n_rows += 1
    if n_rows == 0:
        out_tok[slot, 0] = 0
        return 0
    # ---- fusion
    m = 0
    if n_rows == 1 or mode in (_BACKOFF, _UNIGRAM, _GATE):
        best = 0
        if mode == _GATE:
            for j in range(1, n_rows):  # max of (confidence, -j): ties go to the more specific row
                if pool_conf[rows[j]] > pool_conf[rows[best]]:
                    best = j
        r = rows[best]
        length = pool_len[r]
        if length <= k:  # returned as stored
            for i in range(length):
                mix_tok[i] = pool_ids[r, i]
                mix_p[i] = pool_probs[r, i]
            m = length
        else:
            total = _pysum(pool_probs[r], 0, k)
            if total == 0.0:
                raise ZeroDivisionError("float division by zero")
            for i in range(k):
                mix_tok[i] = pool_ids[r, i]
                mix_p[i] = pool_probs[r, i] / total
            m = k
    else:
        use_prior = mode in (_ENTROPY, _NO_CONFIDENCE)
        use_confidence = mode in (_ENTROPY, _NO_PRIOR)
        for j in range(n_rows):
            weights[j] = (priors[j] if use_prior else 1.0) * (pool_conf[rows[j]] if use_confidence else 1.0)
        norm = _pysum(weights, 0, n_rows)
        if norm == 0.0:
            raise ZeroDivisionError("float division by zero")
        for j in range(n_rows):
            w = weights[j] / norm
            r = rows[j]
            for i in range(pool_len[r]):
                token = pool_ids[r, i]
                p = pool_probs[r, i]
                found = -1
                for q in range(m):
                    if mix_tok[q] == token:
                        found = q
                        break
                if found >= 0:
                    mix_p[found] = mix_p[found] + w * p
                else:
                    mix_tok[m] = token
                    mix_p[m] = 0.0 + w * p
                    m += 1
        # stable sort by mass, descending (insertion sort: equal masses keep first-seen order)
        for i in range(1, m):
            token = mix_tok[i]
            p = mix_p[i]
            j = i - 1
            while j >= 0 and mix_p[j] < p:
                mix_tok[j + 1] = mix_tok[j]
                mix_p[j + 1] = mix_p[j]
                j -= 1
            mix_tok[j + 1] = token
            mix_p[j + 1] = p
        if m > k:
            m = k
        total = _pysum(mix_p, 0, m)
        if total == 0.0:
            raise ZeroDivisionError("float division by zero")
        for i in range(m):
            mix_p[i] = mix_p[i] / total
    # ---- drop excluded tokens (no renormalisation) and repeats of a token already kept (a
    # loaded row can pad with repeated zero-probability ids), then at most `width` children
    count = 0
    n_excluded = excluded.shape[0]
    for i in range(m):
        token = mix_tok[i]
        if 0 <= token < n_excluded and excluded[token]:
            continue
        repeated = False
        for j in range(count):
            if out_tok[slot, j + 1] == token:
                repeated = True
                break
        if repeated:
            continue
        if count == width:
            break
        out_tok[slot, count + 1] = token
        out_p[slot, count] = mix_p[i]
        count += 1
    out_tok[slot, 0] = count
    return count


@njit(cache=True)
def _grow(a):
    """Twice the rows, same contents in front."""
    b = np.empty((2 * a.shape[0], a.shape[1]), a.dtype)
    b[: a.shape[0]] = a
    return b


@njit(cache=True)
def _less(entry_f, entry_i, a, b):
    """Heap order of the reference's tuples (-score, counter, ...); counters are unique."""
    if entry_f[a, 0] < entry_f[b, 0]:
        return True
    if entry_f[a, 0] == entry_f[b, 0]:
        return entry_i[a, 0] < entry_i[b, 0]
    return False


@njit(cache=True)
def _build_tree(unigram, bigram, trigram, pool_ids, pool_probs, pool_conf, pool_len, vocab, u0, v0, x0,
                budget, max_depth, width, k, etas, priors, mode, excluded):
    """The best-first search (the reference's ``ReferenceSearch.build_tree``): (tokens, parents, depths, q)."""
    kp = max(pool_ids.shape[1], 1)
    rows = np.empty(3, np.int64)
    weights = np.empty(3, np.float64)
    mix_tok = np.empty(3 * kp, np.int64)
    mix_p = np.empty(3 * kp, np.float64)
    list_cap = max(1, min(k, width))
    cap = max(4, min(budget, 4096) + 1)
    list_tok = np.empty((cap, list_cap + 1), np.int64)  # column 0: count
    list_p = np.empty((cap, list_cap), np.float64)
    n_lists = 0
    # heap entries: float (negative score, parent score); int (counter, parent node, u, v, x,
    # index, depth, list)
    entry_f = np.empty((2 * cap, 2), np.float64)
    entry_i = np.empty((2 * cap, 8), np.int64)
    n_entries = 0
    heap = np.empty(2 * cap, np.int64)
    size = 0
    # the builder: token, parent, depth, first child, next sibling
    nodes = np.empty((cap, 5), np.int64)
    node_q = np.empty((cap, 1), np.float64)  # the fused probability q of each node's token
    n_nodes = 0
    root_first_child = -1

    count = _fuse(unigram, bigram, trigram, pool_ids, pool_probs, pool_conf, pool_len, vocab, u0, v0, x0, k, width,
                  mode, priors, excluded, rows, weights, mix_tok, mix_p, list_tok, list_p, n_lists)
    if count > 0:
        entry_f[0, 0] = -etas[1] * list_p[n_lists, 0]
        entry_f[0, 1] = 1.0
        entry_i[0, 0] = 0
        entry_i[0, 1] = -1
        entry_i[0, 2] = u0
        entry_i[0, 3] = v0
        entry_i[0, 4] = x0
        entry_i[0, 5] = 0
        entry_i[0, 6] = 1
        entry_i[0, 7] = n_lists
        n_entries = 1
        heap[0] = 0
        size = 1
    n_lists += 1
    counter = 0
    while size > 0 and n_nodes < budget:
        # ---- pop
        e = heap[0]
        size -= 1
        if size > 0:
            last = heap[size]
            i = 0
            while True:
                child = 2 * i + 1
                if child >= size:
                    break
                if child + 1 < size and _less(entry_f, entry_i, heap[child + 1], heap[child]):
                    child += 1
                if _less(entry_f, entry_i, heap[child], last):
                    heap[i] = heap[child]
                    i = child
                else:
                    break
            heap[i] = last
        negative = entry_f[e, 0]
        parent_score = entry_f[e, 1]
        parent = entry_i[e, 1]
        cu = entry_i[e, 2]
        cv = entry_i[e, 3]
        cx = entry_i[e, 4]
        index = entry_i[e, 5]
        depth = entry_i[e, 6]
        lst = entry_i[e, 7]
        token = list_tok[lst, index + 1]
        # ---- builder.add(parent, token): reuse an existing child
        node = root_first_child if parent < 0 else nodes[parent, 3]
        while node >= 0 and nodes[node, 0] != token:
            node = nodes[node, 4]
        if node < 0:
            if n_nodes == nodes.shape[0]:
                nodes = _grow(nodes)
                node_q = _grow(node_q)
            node = n_nodes
            node_q[node, 0] = list_p[lst, index]
            nodes[node, 0] = token
            nodes[node, 1] = parent
            nodes[node, 2] = 1 if parent < 0 else nodes[parent, 2] + 1
            nodes[node, 3] = -1
            if parent < 0:
                nodes[node, 4] = root_first_child
                root_first_child = node
            else:
                nodes[node, 4] = nodes[parent, 3]
                nodes[parent, 3] = node
            n_nodes += 1
        counter += 1
        # ---- pushes: next sibling, then first child
        for push in range(2):
            if push == 0:
                if index + 1 >= list_tok[lst, 0]:
                    continue
                sibling = parent_score * etas[depth] * list_p[lst, index + 1]
                f0 = -sibling
                f1 = parent_score
                c = counter
                p_node, nu, nv, nx, n_index, n_depth, n_list = parent, cu, cv, cx, index + 1, depth, lst
            else:
                if depth >= max_depth:
                    continue
                if n_lists == list_tok.shape[0]:
                    list_tok = _grow(list_tok)
                    list_p = _grow(list_p)
                child_count = _fuse(unigram, bigram, trigram, pool_ids, pool_probs, pool_conf, pool_len, vocab,
                                    cv, cx, token, k, width, mode, priors, excluded, rows, weights, mix_tok, mix_p,
                                    list_tok, list_p, n_lists)
                n_list = n_lists
                n_lists += 1
                if child_count == 0:
                    continue
                counter += 1
                score = -negative
                f0 = -score * etas[depth + 1] * list_p[n_list, 0]
                f1 = score
                c = counter
                p_node, nu, nv, nx, n_index, n_depth = node, cv, cx, token, 0, depth + 1
            if n_entries == entry_f.shape[0]:
                entry_f = _grow(entry_f)
                entry_i = _grow(entry_i)
            if size == heap.shape[0]:
                bigger = np.empty(2 * size, np.int64)
                bigger[:size] = heap
                heap = bigger
            ne = n_entries
            n_entries += 1
            entry_f[ne, 0] = f0
            entry_f[ne, 1] = f1
            entry_i[ne, 0] = c
            entry_i[ne, 1] = p_node
            entry_i[ne, 2] = nu
            entry_i[ne, 3] = nv
            entry_i[ne, 4] = nx
            entry_i[ne, 5] = n_index
            entry_i[ne, 6] = n_depth
            entry_i[ne, 7] = n_list
            # sift up
            i = size
            size += 1
            while i > 0:
                up = (i - 1) // 2
                if _less(entry_f, entry_i, ne, heap[up]):
                    heap[i] = heap[up]
                    i = up
                else:
                    break
            heap[i] = ne
    return nodes[:n_nodes, 0].copy(), nodes[:n_nodes, 1].copy(), nodes[:n_nodes, 2].copy(), node_q[:n_nodes, 0].copy()


# ============================================================================ the Python API
class FastMemory:
    """U/C/G prediction memory with compiled fusion and tree search (see the module docstring).

    ``vocab_size`` bounds the key tokens (every context and tree token must lie in
    [0, vocab_size)); ``top_k`` is the row width stored (the target's Top-K; narrower rows are
    kept with their own length, wider ones are rejected).
    """

    def __init__(self, vocab_size: int, top_k: int):
        if not 1 <= vocab_size <= _MAX_VOCAB:
            raise ValueError(f"vocab_size must be in [1, {_MAX_VOCAB}], got {vocab_size}")
        if top_k < 1:
            raise ValueError("top_k must be at least 1")
        self.vocab_size = int(vocab_size)
        self.top_k = int(top_k)
        self._ids = np.zeros((_MIN_ROWS, self.top_k), dtype=np.int64)
        self._probs = np.zeros((_MIN_ROWS, self.top_k), dtype=np.float64)
        self._conf = np.zeros(_MIN_ROWS, dtype=np.float64)
        self._len = np.zeros(_MIN_ROWS, dtype=np.int64)
        self._n_rows = 0
        self.unigram = _new_map()
        self.bigram = _new_map()
        self.trigram = _new_map()

    # -------------------------------------------------------------- lifecycle
    def reset_request(self) -> None:
        """Clear C and G; compact the pool to the rows U still references."""
        if len(self.bigram):
            self.bigram = _new_map()
        if len(self.trigram):
            self.trigram = _new_map()
        if self._n_rows > len(self.unigram):
            self._n_rows = _compact(self.unigram, self.bigram, self.trigram, self._ids, self._probs, self._conf,
                                    self._len, self._n_rows)
        self._shrink()

    def reset_stream(self) -> None:
        self.unigram = _new_map()
        self.bigram = _new_map()
        self.trigram = _new_map()
        self._n_rows = 0
        self._shrink()

    def snapshot(self) -> FastMemory:
        """A copy of U (the pool and the unigram map), with empty C and G: what a request that
        overlaps another of the same stream drafts from."""
        copy = FastMemory(self.vocab_size, self.top_k)
        for name in ("_ids", "_probs", "_conf", "_len"):
            setattr(copy, name, getattr(self, name).copy())
        copy._n_rows = self._n_rows
        copy.unigram = self.unigram.copy()
        return copy

    def __deepcopy__(self, memo: dict) -> FastMemory:
        """A copy of everything, C and G included (numba's typed maps cannot be pickled, which
        `copy.deepcopy` would do): a deep copy of a stream (the server's throwaway copy for a
        request its memory already holds, `recap.serve.shared`) drafts exactly as the stream."""
        copy = self.snapshot()
        copy.bigram, copy.trigram = self.bigram.copy(), self.trigram.copy()
        memo[id(self)] = copy
        return copy

    # -------------------------------------------------------------- storage
    def _reserve(self, need: int) -> None:
        """Room for ``need`` more rows: the pool doubles when full."""
        used = self._n_rows
        capacity = len(self._conf)
        if used + need <= capacity:
            return
        while used + need > capacity:
            capacity *= 2
        for name in ("_ids", "_probs", "_conf", "_len"):
            old = getattr(self, name)
            new = np.zeros((capacity, *old.shape[1:]), dtype=old.dtype)
            new[:used] = old[:used]
            setattr(self, name, new)

    def _shrink(self) -> None:
        """Give back a pool under a quarter full (to twice its live rows, at least `_MIN_ROWS`):
        halving at a quarter, not at a half, so a stream near the boundary does not reallocate
        at every request."""
        used, capacity = self._n_rows, len(self._conf)
        if capacity <= _MIN_ROWS or 4 * used >= capacity:
            return
        capacity = max(_MIN_ROWS, 2 * used)
        for name in ("_ids", "_probs", "_conf", "_len"):
            setattr(self, name, getattr(self, name)[:capacity].copy())

    def _rows(self, topk_ids: np.ndarray, topk_logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids = np.ascontiguousarray(topk_ids, dtype=np.int64)
        if ids.ndim != 2 or ids.shape[1] > self.top_k or ids.shape[1] < 1:
            raise ValueError(f"Top-K rows must be (n, K) with 1 <= K <= {self.top_k}, got shape {ids.shape}")
        probs, confidence = _softmax_rows(topk_logits)
        if probs.shape != ids.shape:
            raise ValueError(f"topk_ids {ids.shape} and topk_logits {probs.shape} differ in shape")
        return ids, probs, confidence

    # -------------------------------------------------------------- writes
    def seed_from_prompt(self, ids: np.ndarray, topk_ids: np.ndarray, topk_logits: np.ndarray,
                         eligible: np.ndarray) -> None:
        """U[token] <- the prefill row at each eligible token's first occurrence in the prompt."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        positions = first_eligible(ids, eligible)  # the rows a ``first`` prefill computes
        if not len(positions):
            return
        row_ids, probs, confidence = self._rows(*rows_at(topk_ids, topk_logits, positions))
        self._reserve(len(positions))
        n_rows = _store_unigram(self.unigram, self._ids, self._probs, self._conf, self._len, self._n_rows,
                                self.vocab_size, ids[positions], row_ids, probs, confidence)
        if n_rows < 0:
            raise ValueError(f"eligible prompt tokens must lie in [0, {self.vocab_size})")
        self._n_rows = n_rows

    def refresh(self, context: Sequence[int], tree_tokens: np.ndarray, tree_parents: np.ndarray,
                topk_ids: np.ndarray, topk_logits: np.ndarray, contextual: bool = True) -> None:
        """Store the rows of every packed position (root = ``context[2]`` at 0, node i at
        i + 1), accepted and rejected, under its path context; first occurrence in the batch wins;
        ``contextual=False`` writes U only."""
        u, v, x = (int(t) for t in context)
        tokens = np.ascontiguousarray(tree_tokens, dtype=np.int64).reshape(-1)
        parents = np.ascontiguousarray(tree_parents, dtype=np.int64).reshape(-1)
        if len(parents) != len(tokens):
            raise ValueError(f"{len(tokens)} tree tokens but {len(parents)} parents")
        row_ids, probs, confidence = self._rows(topk_ids, topk_logits)
        if len(row_ids) != len(tokens) + 1:
            raise ValueError(f"{len(row_ids)} Top-K rows for {len(tokens) + 1} packed positions")
        self._reserve(len(row_ids))
        n_rows = _refresh(self.unigram, self.bigram, self.trigram, self._ids, self._probs, self._conf, self._len,
                          self._n_rows, self.vocab_size, u, v, x, tokens, parents, row_ids, probs, confidence,
                          bool(contextual))
        if n_rows < 0:
            raise ValueError(f"context and tree tokens must lie in [0, {self.vocab_size}) and parents must be "
                             "ROOT (-1) or an earlier node")
        self._n_rows = n_rows

    # -------------------------------------------------------------- drafting
    def build_tree(self, context: Sequence[int], budget: int, max_depth: int, width: int, top_k: int,
                   etas: np.ndarray, priors: np.ndarray, mode: int | str = 0,
                   excluded: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """RECAP's best-first tree: (tokens, parents, depths, q), parents before children;
        ``q[i]`` is the fused probability of node i's token under its parent's context.

        ``etas[d]`` is the depth prior of depth d (``etas[0]`` unused; at least ``max_depth + 1``
        entries); ``priors`` the three rank priors; ``mode`` a `FUSION_CODES` code or name;
        ``excluded`` a boolean mask over the vocabulary (or None)."""
        u, v, x = (int(t) for t in context)
        if not 0 <= x < self.vocab_size:
            raise ValueError(f"context token {x} outside [0, {self.vocab_size})")
        etas = np.ascontiguousarray(etas, dtype=np.float64)
        if len(etas) < max_depth + 1:
            raise ValueError(f"etas needs max_depth + 1 = {max_depth + 1} entries, has {len(etas)}")
        priors = np.ascontiguousarray(priors, dtype=np.float64)
        if len(priors) < 3:
            raise ValueError("priors needs three entries")
        if top_k < 1 or width < 1 or max_depth < 1:
            raise ValueError("top_k, width and max_depth must be at least 1")
        mask = _NO_EXCLUSION if excluded is None else np.asarray(excluded, dtype=np.bool_)
        return _build_tree(self.unigram, self.bigram, self.trigram, self._ids, self._probs, self._conf, self._len,
                           self.vocab_size, u, v, x, int(budget), int(max_depth), int(width), int(top_k), etas, priors,
                           fusion_code(mode), mask)

    # -------------------------------------------------------------- persistence
    def unigram_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """U as (keys int64 [n] ascending, ids int64 [n, K], probs float64 [n, K]), K the widest
        row, narrower rows zero-padded: the layout `save_token_memory` writes."""
        return _unigram_arrays(self.unigram, self._ids, self._probs, self._len)

    def load_unigram(self, keys: np.ndarray, ids: np.ndarray, probs: np.ndarray) -> None:
        """U[keys[i]] <- row i, exactly as `TokenMemoryFile.install` does it: log-probabilities
        are treated as logits (zero probabilities as -1e30), so probabilities are renormalised
        and confidences recomputed through the live-row code path."""
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        if not len(keys):
            return
        probs = np.asarray(probs)
        with np.errstate(divide="ignore"):
            logits = np.log(probs)
        row_ids, row_probs, confidence = self._rows(ids, np.where(np.isfinite(logits), logits, -1e30))
        if len(row_ids) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(row_ids)} rows")
        self._reserve(len(keys))
        n_rows = _store_unigram(self.unigram, self._ids, self._probs, self._conf, self._len, self._n_rows,
                                self.vocab_size, keys, row_ids, row_probs, confidence)
        if n_rows < 0:
            raise ValueError(f"keys must lie in [0, {self.vocab_size})")
        self._n_rows = n_rows

    # -------------------------------------------------------------- inspection
    def counts(self) -> tuple[int, int, int]:
        """Entries in (U, C, G)."""
        return len(self.unigram), len(self.bigram), len(self.trigram)

    def drop_unigram(self, keys) -> None:
        """Forget U's rows of ``keys`` (eviction); their pool slots are reclaimed at the next
        compaction (`reset_request`)."""
        for key in keys:
            key = int(key)
            if key in self.unigram:
                del self.unigram[key]

    def __len__(self) -> int:
        return sum(self.counts())

    def nbytes(self) -> int:
        """Bytes held: the row pool as allocated plus ~32 bytes per map entry (numba dict:
        key, value, hash, index)."""
        pool = self._ids.nbytes + self._probs.nbytes + self._conf.nbytes + self._len.nbytes
        return pool + 32 * len(self)

    @property
    def pool_rows(self) -> tuple[int, int]:
        """(rows in use, garbage included; capacity)."""
        return self._n_rows, len(self._conf)

    def table(self, name: str) -> dict[tuple[int, ...], tuple[tuple[int, ...], tuple[float, ...], float]]:
        """One map as a plain dict shaped like the reference memory's (``unigram`` keys are 1-tuples
        here): key tokens -> (ids, probs, confidence). For tests and debugging; slow."""
        table = {"unigram": self.unigram, "bigram": self.bigram, "trigram": self.trigram}[name]
        vocab = self.vocab_size
        out = {}
        for key in _keys_of(table).tolist():
            ids, probs, confidence = _row_of(table, self._ids, self._probs, self._conf, self._len, key)
            if name == "unigram":
                tokens = (key,)
            elif name == "bigram":
                tokens = (key // vocab, key % vocab)
            else:
                tokens = (key // (vocab * vocab), key // vocab % vocab, key % vocab)
            out[tokens] = (tuple(ids.tolist()), tuple(probs.tolist()), float(confidence))
        return out
