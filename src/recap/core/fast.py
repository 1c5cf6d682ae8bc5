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
(3-token) are request-local, kept per request key (`MAIN`, the stream's own request, or an
overlapping request's), the way SuffixDecoding keeps one tree per request beside its global
one: requests of one stream that overlap share U and the pool, each with its own C and G. Each
key keeps its most recently written row; within one verification batch the first occurrence
of a key wins.

Storage: a row pool (`Pool`: ``ids`` int64 [R, K], ``probs`` float64 [R, K], ``confidence``
float64 [R], ``length`` int64 [R]) and three numba typed dicts mapping an int64 key to a pool
row: U key ``x``, C key ``v * V + x``, G key ``(u * V + v) * V + x`` (V = vocabulary size).
Rows whose keys were all overwritten stay in the pool as garbage until ``reset_request`` or
``end_request`` compacts the pool (in place) to the rows U and the live requests' maps still
reference; within a request the pool
doubles when full, so it holds at most U's rows at the request start plus one row per position
the request evaluated (the order of C and G's own growth). A compaction that leaves the pool
less than a quarter full shrinks it to twice the live rows (at least 256), so a stream that
lives as long as a server gives back what a long request or an eviction freed.

The kernels take named tuples, not long argument lists: `Tables` (the three maps, the pool's
arrays and V: everything lookup reads), `Rows` (rows being written), `Fusion` (Top-K, width,
mode, rank priors, excluded mask) and `Scratch` (fusion's buffers); the tree search's heap
entries and nodes are arrays with named columns (``_E_*``, ``_N_*``).

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
from collections import namedtuple
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
MAIN = 0
"""The request key of a stream's own request; an overlapping one has a key of its own
(`RecapProposer.fork_request`)."""
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
# What the kernels take, by name. Named tuples are made at the top of the compiled entry
# points, not in Python: numba types a plain tuple of arrays and ints in C at each call, a
# namedtuple in Python (~1 us), a tuple holding typed Dicts in Python too (~80 us). So the
# pool, new rows and fusion settings cross as plain tuples in their fields' order, the maps
# as separate arguments.
Pool = namedtuple("Pool", "ids probs confidence length")
"""The row pool: ids int64 [R, K], probs float64 [R, K], confidence float64 [R], length int64 [R]."""
Tables = namedtuple("Tables", "unigram bigram trigram ids probs confidence length vocab")
"""RECAP's memory as the kernels read it: U, C, G (int64 key -> pool row), the pool, V."""
Rows = namedtuple("Rows", "ids probs confidence")
"""Rows being written: ids int64 [n, K], probs float64 [n, K], confidence float64 [n]."""
Fusion = namedtuple("Fusion", "k width mode priors excluded")
"""How fused lists are made: cut to ``k`` (Top-K) then ``width`` children, a `FUSION_CODES`
``mode``, the rank ``priors`` and the ``excluded`` mask (bool [V] or empty)."""
Scratch = namedtuple("Scratch", "rows weights mix_tok mix_p")
"""Fusion's buffers: the rows found (3), their weights (3), the mixture (3 * K)."""

# Columns of `_best_first`'s arrays (module constants: compile-time constants to numba).
# Heap entries, float part: the entry's negated score (the heap key), its parent's score.
_E_NEG_SCORE, _E_PARENT_SCORE = range(2)
# Heap entries, int part: the tie-break counter, the parent node, the context (u, v, x) the
# list was fused for, the index in that list, the depth, the list.
_E_COUNTER, _E_PARENT, _E_U, _E_V, _E_X, _E_INDEX, _E_DEPTH, _E_LIST = range(8)
# Tree nodes: token, parent, depth, first child, next sibling.
_N_TOKEN, _N_PARENT, _N_DEPTH, _N_FIRST_CHILD, _N_NEXT_SIBLING = range(5)


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


@njit(cache=True, inline="always")
def _store_row(pool, slot, new, r):
    """Pool row ``slot`` <- row ``r`` of ``new`` (inlined: no reference counting of the
    tuples' fields at each row)."""
    ids, probs, confidence = new
    width = ids.shape[1]
    pool_ids, pool_probs = pool.ids, pool.probs  # read once (see `_fuse`)
    for j in range(width):
        pool_ids[slot, j] = ids[r, j]
        pool_probs[slot, j] = probs[r, j]
    pool.length[slot] = width
    pool.confidence[slot] = confidence[r]


@njit(cache=True)
def _store_step(unigram, bigram, trigram, pool, n_rows, vocab, context, tree, new, contextual):
    """FastMemory.refresh (``tree``: tokens, parents). Returns the new row count, or -1
    (nothing written) when a key token is outside [0, vocab) or a parent is not an earlier node."""
    pool, new = Pool(*pool), Rows(*new)
    u0, v0, x0 = context
    tree_tokens, tree_parents = tree
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
            _store_row(pool, slot, new, p)
            n_rows += 1
            unigram[x] = slot
        if contextual and v >= 0:
            key = v * vocab + x
            if bigram.get(key, -1) < start:
                if slot < 0:
                    slot = n_rows
                    _store_row(pool, slot, new, p)
                    n_rows += 1
                bigram[key] = slot
            if u >= 0:
                key = (u * vocab + v) * vocab + x
                if trigram.get(key, -1) < start:
                    if slot < 0:
                        slot = n_rows
                        _store_row(pool, slot, new, p)
                        n_rows += 1
                    trigram[key] = slot
    return n_rows


@njit(cache=True)
def _store_unigram(unigram, pool, n_rows, vocab, keys, new):
    """U[keys[i]] <- row i of ``new`` (later rows win). -1 when a key is outside [0, vocab)."""
    pool, new = Pool(*pool), Rows(*new)
    for i in range(keys.shape[0]):
        if keys[i] < 0 or keys[i] >= vocab:
            return -1
    for i in range(keys.shape[0]):
        _store_row(pool, n_rows, new, i)
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
def _move_rows(pool, used, n_rows):
    """Move the rows marked ``used`` to the front of the pool, in order (in place). Returns
    (their new index, -1 for the others; their count)."""
    pool = Pool(*pool)
    new_index = np.empty(n_rows, np.int64)
    live = 0
    for r in range(n_rows):
        if used[r]:
            new_index[r] = live
            if live != r:
                pool.ids[live] = pool.ids[r]
                pool.probs[live] = pool.probs[r]
                pool.confidence[live] = pool.confidence[r]
                pool.length[live] = pool.length[r]
            live += 1
        else:
            new_index[r] = -1
    return new_index, live


@njit(cache=True)
def _unigram_arrays(unigram, pool):
    pool_ids, pool_probs, _, pool_len = pool
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
def _row_of(table, pool, key):
    pool = Pool(*pool)
    r = table[key]
    length = pool.length[r]
    return pool.ids[r, :length].copy(), pool.probs[r, :length].copy(), pool.confidence[r]


@njit(cache=True)
def _fuse(tables, context, fusion, scratch, out_tok, out_p, slot):
    """Lookup + fusion for ``context`` (u, v, x) (the reference's ``ReferenceSearch.fused``),
    written to out_tok[slot, 1:] (count in out_tok[slot, 0]) and out_p[slot]. Returns the count."""
    u, v, x = context
    k, width, mode, priors, excluded = fusion
    rows, weights, mix_tok, mix_p = scratch
    # the pool's arrays as locals, read once: a tuple's array field read in a loop costs
    # reference counting at each read (the maps, read once each, are not worth it)
    ids, probs, confidence, lengths, vocab = tables.ids, tables.probs, tables.confidence, tables.length, tables.vocab
    # ---- lookup: G, C, U (most specific first), or U alone for mode "unigram"
    n_rows = 0
    if mode != _UNIGRAM:
        if u >= 0 and v >= 0:
            r = tables.trigram.get((u * vocab + v) * vocab + x, -1)
            if r >= 0:
                rows[n_rows] = r
                n_rows += 1
        if v >= 0:
            r = tables.bigram.get(v * vocab + x, -1)
            if r >= 0:
                rows[n_rows] = r
                n_rows += 1
    r = tables.unigram.get(x, -1)
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
                if confidence[rows[j]] > confidence[rows[best]]:
                    best = j
        r = rows[best]
        length = lengths[r]
        if length <= k:  # returned as stored
            for i in range(length):
                mix_tok[i] = ids[r, i]
                mix_p[i] = probs[r, i]
            m = length
        else:
            total = _pysum(probs[r], 0, k)
            if total == 0.0:
                raise ZeroDivisionError("float division by zero")
            for i in range(k):
                mix_tok[i] = ids[r, i]
                mix_p[i] = probs[r, i] / total
            m = k
    else:
        use_prior = mode in (_ENTROPY, _NO_CONFIDENCE)
        use_confidence = mode in (_ENTROPY, _NO_PRIOR)
        for j in range(n_rows):
            weights[j] = (priors[j] if use_prior else 1.0) * (confidence[rows[j]] if use_confidence else 1.0)
        norm = _pysum(weights, 0, n_rows)
        if norm == 0.0:
            raise ZeroDivisionError("float division by zero")
        for j in range(n_rows):
            w = weights[j] / norm
            r = rows[j]
            for i in range(lengths[r]):
                token = ids[r, i]
                p = probs[r, i]
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
    if entry_f[a, _E_NEG_SCORE] < entry_f[b, _E_NEG_SCORE]:
        return True
    if entry_f[a, _E_NEG_SCORE] == entry_f[b, _E_NEG_SCORE]:
        return entry_i[a, _E_COUNTER] < entry_i[b, _E_COUNTER]
    return False


@njit(cache=True)
def _best_first(unigram, bigram, trigram, pool, vocab, root, budget, max_depth, etas, fusion):
    """The best-first search (the reference's ``ReferenceSearch.build_tree``) from context
    ``root`` (u, v, x): (tokens, parents, depths, q)."""
    ids, probs, confidence, length = pool
    tables = Tables(unigram, bigram, trigram, ids, probs, confidence, length, vocab)
    fusion = Fusion(*fusion)
    u0, v0, x0 = root
    kp = max(ids.shape[1], 1)
    scratch = Scratch(np.empty(3, np.int64), np.empty(3, np.float64), np.empty(3 * kp, np.int64),
                      np.empty(3 * kp, np.float64))
    list_cap = max(1, min(fusion.k, fusion.width))
    cap = max(4, min(budget, 4096) + 1)
    list_tok = np.empty((cap, list_cap + 1), np.int64)  # column 0: count
    list_p = np.empty((cap, list_cap), np.float64)
    n_lists = 0
    # heap entries: columns _E_* of a float and an int part
    entry_f = np.empty((2 * cap, 2), np.float64)
    entry_i = np.empty((2 * cap, 8), np.int64)
    n_entries = 0
    heap = np.empty(2 * cap, np.int64)
    size = 0
    # the builder: columns _N_*
    nodes = np.empty((cap, 5), np.int64)
    node_q = np.empty((cap, 1), np.float64)  # the fused probability q of each node's token
    n_nodes = 0
    root_first_child = -1

    count = _fuse(tables, root, fusion, scratch, list_tok, list_p, n_lists)
    if count > 0:
        entry_f[0, _E_NEG_SCORE] = -etas[1] * list_p[n_lists, 0]
        entry_f[0, _E_PARENT_SCORE] = 1.0
        entry_i[0, _E_COUNTER] = 0
        entry_i[0, _E_PARENT] = -1
        entry_i[0, _E_U] = u0
        entry_i[0, _E_V] = v0
        entry_i[0, _E_X] = x0
        entry_i[0, _E_INDEX] = 0
        entry_i[0, _E_DEPTH] = 1
        entry_i[0, _E_LIST] = n_lists
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
        negative = entry_f[e, _E_NEG_SCORE]
        parent_score = entry_f[e, _E_PARENT_SCORE]
        parent = entry_i[e, _E_PARENT]
        cu = entry_i[e, _E_U]
        cv = entry_i[e, _E_V]
        cx = entry_i[e, _E_X]
        index = entry_i[e, _E_INDEX]
        depth = entry_i[e, _E_DEPTH]
        lst = entry_i[e, _E_LIST]
        token = list_tok[lst, index + 1]
        # ---- builder.add(parent, token): reuse an existing child
        node = root_first_child if parent < 0 else nodes[parent, _N_FIRST_CHILD]
        while node >= 0 and nodes[node, _N_TOKEN] != token:
            node = nodes[node, _N_NEXT_SIBLING]
        if node < 0:
            if n_nodes == nodes.shape[0]:
                nodes = _grow(nodes)
                node_q = _grow(node_q)
            node = n_nodes
            node_q[node, 0] = list_p[lst, index]
            nodes[node, _N_TOKEN] = token
            nodes[node, _N_PARENT] = parent
            nodes[node, _N_DEPTH] = 1 if parent < 0 else nodes[parent, _N_DEPTH] + 1
            nodes[node, _N_FIRST_CHILD] = -1
            if parent < 0:
                nodes[node, _N_NEXT_SIBLING] = root_first_child
                root_first_child = node
            else:
                nodes[node, _N_NEXT_SIBLING] = nodes[parent, _N_FIRST_CHILD]
                nodes[parent, _N_FIRST_CHILD] = node
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
                child_count = _fuse(tables, (cv, cx, token), fusion, scratch, list_tok, list_p, n_lists)
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
            entry_f[ne, _E_NEG_SCORE] = f0
            entry_f[ne, _E_PARENT_SCORE] = f1
            entry_i[ne, _E_COUNTER] = c
            entry_i[ne, _E_PARENT] = p_node
            entry_i[ne, _E_U] = nu
            entry_i[ne, _E_V] = nv
            entry_i[ne, _E_X] = nx
            entry_i[ne, _E_INDEX] = n_index
            entry_i[ne, _E_DEPTH] = n_depth
            entry_i[ne, _E_LIST] = n_list
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
    return (nodes[:n_nodes, _N_TOKEN].copy(), nodes[:n_nodes, _N_PARENT].copy(), nodes[:n_nodes, _N_DEPTH].copy(),
            node_q[:n_nodes, 0].copy())


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
        self._pool = Pool(np.zeros((_MIN_ROWS, self.top_k), dtype=np.int64),
                          np.zeros((_MIN_ROWS, self.top_k), dtype=np.float64),
                          np.zeros(_MIN_ROWS, dtype=np.float64), np.zeros(_MIN_ROWS, dtype=np.int64))
        self._n_rows = 0
        self.unigram = _new_map()
        self._contexts: dict[int, tuple] = {}
        """Request key -> (C, G) of that request (`MAIN`: the stream's own)."""

    def _maps(self, request: int) -> tuple:
        """(C, G) of ``request``, empty ones for a request not seen yet."""
        maps = self._contexts.get(request)
        if maps is None:
            maps = self._contexts[request] = (_new_map(), _new_map())
        return maps

    # -------------------------------------------------------------- lifecycle
    def reset_request(self, request: int = MAIN) -> None:
        """Clear ``request``'s C and G; compact the pool to the rows still referenced (by U and
        the other requests' maps)."""
        if request in self._contexts and any(len(table) for table in self._contexts[request]):
            self._contexts[request] = (_new_map(), _new_map())
        self._compact()

    def end_request(self, request: int) -> None:
        """Forget ``request``'s C and G (an overlapping request that ended) and compact."""
        self._contexts.pop(request, None)
        self._compact()

    def _compact(self) -> None:
        tables = [self.unigram, *(table for maps in self._contexts.values() for table in maps)]
        if self._n_rows > len(self.unigram):
            used = np.zeros(self._n_rows, np.bool_)
            for table in tables:
                _mark(table, used)
            new_index, live = _move_rows(tuple(self._pool), used, self._n_rows)
            if live != self._n_rows:
                for table in tables:
                    _remap(table, new_index)
            self._n_rows = live
        self._shrink()

    def reset_stream(self) -> None:
        """Forget U and every request's C and G."""
        self.unigram = _new_map()
        self._contexts.clear()
        self._n_rows = 0
        self._shrink()

    def __deepcopy__(self, memo: dict) -> FastMemory:
        """A copy of everything, every request's C and G included (numba's typed maps cannot
        be pickled, which `copy.deepcopy` would do): a deep copy of a stream (the server's
        throwaway copy for a request its memory already holds, `recap.serve.shared`) drafts
        exactly as the stream."""
        copy = FastMemory(self.vocab_size, self.top_k)
        copy._pool = Pool(*(array.copy() for array in self._pool))
        copy._n_rows = self._n_rows
        copy.unigram = self.unigram.copy()
        copy._contexts = {key: (bigram.copy(), trigram.copy()) for key, (bigram, trigram) in self._contexts.items()}
        memo[id(self)] = copy
        return copy

    # -------------------------------------------------------------- storage
    def _reserve(self, need: int) -> None:
        """Room for ``need`` more rows: the pool doubles when full."""
        used = self._n_rows
        capacity = len(self._pool.confidence)
        if used + need <= capacity:
            return
        while used + need > capacity:
            capacity *= 2
        arrays = []
        for old in self._pool:
            new = np.zeros((capacity, *old.shape[1:]), dtype=old.dtype)
            new[:used] = old[:used]
            arrays.append(new)
        self._pool = Pool(*arrays)

    def _shrink(self) -> None:
        """Give back a pool under a quarter full (to twice its live rows, at least `_MIN_ROWS`):
        halving at a quarter, not at a half, so a stream near the boundary does not reallocate
        at every request."""
        used, capacity = self._n_rows, len(self._pool.confidence)
        if capacity <= _MIN_ROWS or 4 * used >= capacity:
            return
        capacity = max(_MIN_ROWS, 2 * used)
        self._pool = Pool(*(array[:capacity].copy() for array in self._pool))

    def _rows(self, topk_ids: np.ndarray, topk_logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """New rows (ids, probs, confidence): a `Rows` as the kernels take it."""
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
        rows = self._rows(*rows_at(topk_ids, topk_logits, positions))
        self._reserve(len(positions))
        n_rows = _store_unigram(self.unigram, tuple(self._pool), self._n_rows, self.vocab_size, ids[positions], rows)
        if n_rows < 0:
            raise ValueError(f"eligible prompt tokens must lie in [0, {self.vocab_size})")
        self._n_rows = n_rows

    def refresh(self, context: Sequence[int], tree_tokens: np.ndarray, tree_parents: np.ndarray,
                topk_ids: np.ndarray, topk_logits: np.ndarray, contextual: bool = True, *,
                request: int = MAIN) -> None:
        """Store the rows of every packed position (root = ``context[2]`` at 0, node i at
        i + 1), accepted and rejected, under its path context, in U and ``request``'s C and G;
        first occurrence in the batch wins; ``contextual=False`` writes U only."""
        u, v, x = (int(t) for t in context)
        tokens = np.ascontiguousarray(tree_tokens, dtype=np.int64).reshape(-1)
        parents = np.ascontiguousarray(tree_parents, dtype=np.int64).reshape(-1)
        if len(parents) != len(tokens):
            raise ValueError(f"{len(tokens)} tree tokens but {len(parents)} parents")
        rows = self._rows(topk_ids, topk_logits)
        n = len(rows[0])
        if n != len(tokens) + 1:
            raise ValueError(f"{n} Top-K rows for {len(tokens) + 1} packed positions")
        self._reserve(n)
        bigram, trigram = self._maps(request)
        n_rows = _store_step(self.unigram, bigram, trigram, tuple(self._pool), self._n_rows, self.vocab_size,
                          (u, v, x), (tokens, parents), rows, bool(contextual))
        if n_rows < 0:
            raise ValueError(f"context and tree tokens must lie in [0, {self.vocab_size}) and parents must be "
                             "ROOT (-1) or an earlier node")
        self._n_rows = n_rows

    # -------------------------------------------------------------- drafting
    def build_tree(self, context: Sequence[int], budget: int, max_depth: int, width: int, top_k: int,
                   etas: np.ndarray, priors: np.ndarray, mode: int | str = 0,
                   excluded: np.ndarray | None = None, *,
                   request: int = MAIN) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """RECAP's best-first tree from U and ``request``'s C and G: (tokens, parents, depths,
        q), parents before children;
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
        fusion = (int(top_k), int(width), fusion_code(mode), priors, mask)  # a `Fusion`
        bigram, trigram = self._maps(request)
        return _best_first(self.unigram, bigram, trigram, tuple(self._pool), self.vocab_size, (u, v, x),
                           int(budget), int(max_depth), etas, fusion)

    # -------------------------------------------------------------- persistence
    def unigram_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """U as (keys int64 [n] ascending, ids int64 [n, K], probs float64 [n, K]), K the widest
        row, narrower rows zero-padded: the layout `save_token_memory` writes."""
        return _unigram_arrays(self.unigram, tuple(self._pool))

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
        rows = self._rows(ids, np.where(np.isfinite(logits), logits, -1e30))
        if len(rows[0]) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(rows[0])} rows")
        self._reserve(len(keys))
        n_rows = _store_unigram(self.unigram, tuple(self._pool), self._n_rows, self.vocab_size, keys, rows)
        if n_rows < 0:
            raise ValueError(f"keys must lie in [0, {self.vocab_size})")
        self._n_rows = n_rows

    # -------------------------------------------------------------- inspection
    def counts(self, request: int = MAIN) -> tuple[int, int, int]:
        """Entries in (U, C, G) of ``request``."""
        bigram, trigram = self._contexts.get(request, ((), ()))
        return len(self.unigram), len(bigram), len(trigram)

    def drop_unigram(self, keys) -> None:
        """Forget U's rows of ``keys`` (eviction); their pool slots are reclaimed at the next
        compaction (`reset_request`)."""
        for key in keys:
            key = int(key)
            if key in self.unigram:
                del self.unigram[key]

    def __len__(self) -> int:
        """Entries in U and every request's C and G."""
        return len(self.unigram) + sum(len(table) for maps in self._contexts.values() for table in maps)

    def nbytes(self) -> int:
        """Bytes held: the row pool as allocated plus ~32 bytes per map entry (numba dict:
        key, value, hash, index)."""
        return sum(array.nbytes for array in self._pool) + 32 * len(self)

    @property
    def pool_rows(self) -> tuple[int, int]:
        """(rows in use, garbage included; capacity)."""
        return self._n_rows, len(self._pool.confidence)

    def table(self, name: str,
              request: int = MAIN) -> dict[tuple[int, ...], tuple[tuple[int, ...], tuple[float, ...], float]]:
        """One map as a plain dict shaped like the reference memory's (``unigram`` keys are 1-tuples
        here): key tokens -> (ids, probs, confidence). For tests and debugging; slow."""
        bigram, trigram = self._contexts.get(request, (_new_map(), _new_map()))
        table = {"unigram": self.unigram, "bigram": bigram, "trigram": trigram}[name]
        vocab = self.vocab_size
        out = {}
        for key in _keys_of(table).tolist():
            ids, probs, confidence = _row_of(table, tuple(self._pool), key)
            if name == "unigram":
                tokens = (key,)
            elif name == "bigram":
                tokens = (key // vocab, key % vocab)
            else:
                tokens = (key // (vocab * vocab), key // vocab % vocab, key % vocab)
            out[tokens] = (tuple(ids.tolist()), tuple(probs.tolist()), float(confidence))
        return out
