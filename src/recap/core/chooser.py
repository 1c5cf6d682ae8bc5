"""Per-step tree size: draft the prefix of candidates that buys the most tokens per second.

Each candidate node carries ``prob``, the estimated probability that it is accepted given
that its parent was. The probability that its whole path is accepted is the product along
the path, never larger than its parent's, so candidates sorted by it (ties: shallower first)
put every parent before its children: each prefix is a valid tree. A tree's expected tokens
per step is 1 + the sum of its nodes' path probabilities (the bonus token is always
committed), and the step costs t(1 + N) (root included). The chosen size maximises

    (1 + sum of the first N path probabilities) / t(1 + N),   N = 0 (a plain step) included.

Near the request's end the step is not one of many alike: a path that reaches the last token
the request may commit, or ends in a stop token (EOS: a repeated answer's end), saves the whole
next step when it is accepted, which the per-step rate does not see (`_best_size_to_end`
credits it). On a cost curve that is near linear past a few rows this is what lets a long
exact repeat finish in one step instead of leaving two tokens for a third. Nodes below a stop
token are never drafted: nothing after it is committed.

Numpy over at most a few hundred nodes: tens of microseconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit

from recap.core.cost import CostProfile
from recap.core.tree import DraftTree

SOURCES_PER_NODE = 3
"""A node can be offered by the recycled tree, the request's continuation and the store's."""


# ============================================================================ compiled kernels
@njit(cache=True)
def _add_chain(tokens, parents, depths, probs, cells, priors, n, new):
    """Insert the chain ``new`` (tokens, probs, cells, priors) along a root path (arrays have
    room for it); returns the new count."""
    chain, chain_probs, chain_cells, chain_priors = new
    parent = -1
    fresh = False  # once a node is new, none of the nodes after it exists yet
    for j in range(chain.shape[0]):
        token = chain[j]
        node = -1
        if not fresh:
            for i in range(n):
                if parents[i] == parent and tokens[i] == token:
                    node = i
                    break
        if node < 0:
            fresh = True
            node = n
            tokens[n] = token
            parents[n] = parent
            depths[n] = 1 if parent < 0 else depths[parent] + 1
            probs[n] = chain_probs[j]
            cells[n, 0] = chain_cells[j]
            priors[n, 0] = chain_priors[j]
            for c in range(1, cells.shape[1]):
                cells[n, c] = -1
                priors[n, c] = np.nan
            n += 1
        else:
            if chain_probs[j] > probs[node]:
                probs[node] = chain_probs[j]
            for c in range(cells.shape[1]):
                if cells[node, c] < 0:
                    cells[node, c] = chain_cells[j]
                    priors[node, c] = chain_priors[j]
                    break
        parent = node
    return n


@njit(cache=True)
def _path_probs(parents, probs, n):
    path = np.empty(n, np.float64)
    for i in range(n):
        parent = parents[i]
        path[i] = probs[i] * (path[parent] if parent >= 0 else 1.0)
    return path


@njit(cache=True)
def _order(path, depths, n):
    """Indices by path probability, descending; ties shallower first (stable two-pass sort)."""
    by_depth = np.argsort(depths[:n], kind="mergesort")
    return by_depth[np.argsort(-path[by_depth], kind="mergesort")]


@njit(cache=True)
def _best_size(sorted_path, curve, n_max, base=1.0):
    """argmax over N in [0, n_max] of (base + sum of the first N) / curve[N] (first maximum);
    base: the tokens committed anyway (one bonus token per request)."""
    best = 0
    expected = base
    best_value = expected / curve[0]
    for k in range(1, n_max + 1):
        expected += sorted_path[k - 1]
        value = expected / curve[k]
        if value > best_value:
            best_value = value
            best = k
    return best


@njit(cache=True)
def _best_size_to_end(sorted_path, finishes, curve, n_max, plain_best):
    """`_best_size` for a step that can finish the request: a node that ``finishes`` (its
    depth is all the request still needs) saves, when its whole path is accepted, the next
    step outright. That step would cost at least t(1) = curve[0] and commit its own bonus
    token, so finishing is worth ``r * t(1) - 1`` extra tokens at this step's best plain rate
    r, weighted by the best finishing node's path probability among the first N."""
    rate = 1.0
    for k in range(plain_best):
        rate += sorted_path[k]
    rate /= curve[plain_best]
    bonus = max(0.0, rate * curve[0] - 1.0)
    best = 0
    expected = 1.0
    best_value = expected / curve[0]
    end_prob = 0.0
    for k in range(1, n_max + 1):
        expected += sorted_path[k - 1]
        if finishes[k - 1] and end_prob == 0.0:  # sorted: the first finishing node is the likeliest
            end_prob = sorted_path[k - 1]
        value = (expected + end_prob * bonus) / curve[k]
        if value > best_value:
            best_value = value
            best = k
    return best


@njit(cache=True)
def _stops(tokens, parents, stop_ids, n):
    """(is a stop token, has a stop token among its ancestors) per node, parents before
    children; one compiled pass (``np.isin`` and a second pass cost ~60 µs a step)."""
    stop = np.zeros(n, np.bool_)
    below = np.zeros(n, np.bool_)
    for i in range(n):
        for s in stop_ids:
            if tokens[i] == s:
                stop[i] = True
        parent = parents[i]
        below[i] = parent >= 0 and (stop[parent] or below[parent])
    return stop, below


@njit(cache=True)
def _subtree(chosen, tokens, parents, depths, n):
    """The chosen nodes (parents first) as a tree of their own: tokens, parents, depths."""
    size = chosen.shape[0]
    new_index = np.full(n, -1, np.int64)
    out_tokens = np.empty(size, np.int64)
    out_parents = np.empty(size, np.int64)
    out_depths = np.empty(size, np.int64)
    for k in range(size):
        i = chosen[k]
        new_index[i] = k
        out_tokens[k] = tokens[i]
        parent = parents[i]
        out_parents[k] = -1 if parent < 0 else new_index[parent]
        out_depths[k] = depths[i]
    return out_tokens, out_parents, out_depths


# ============================================================================ the Python API
class Candidates:
    """A tree of candidate nodes under construction (parents before children), each with an
    acceptance estimate, the calibration cells of the sources that proposed it (-1: none) and
    each source's prior for the node (NaN: its cell's own; `recap.core.calibration`)."""

    def __init__(self, tokens: Sequence[int] | np.ndarray, parents: Sequence[int] | np.ndarray,
                 depths: Sequence[int] | np.ndarray, probs: Sequence[float] | np.ndarray,
                 cells: Sequence[int] | np.ndarray, room: int = 96,
                 priors: Sequence[float] | np.ndarray | None = None):
        n = len(tokens)
        capacity = n + room
        self.n = n
        self._tokens = np.empty(capacity, np.int64)
        self._parents = np.empty(capacity, np.int64)
        self._depths = np.empty(capacity, np.int64)
        self._probs = np.empty(capacity, np.float64)
        self._cells = np.full((capacity, SOURCES_PER_NODE), -1, np.int64)
        self._priors = np.full((capacity, SOURCES_PER_NODE), np.nan, np.float64)
        self._tokens[:n] = tokens
        self._parents[:n] = parents
        self._depths[:n] = depths
        self._probs[:n] = probs
        self._cells[:n, 0] = cells
        if priors is not None:
            self._priors[:n, 0] = priors

    def __len__(self) -> int:
        return self.n

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens[: self.n]

    @property
    def parents(self) -> np.ndarray:
        return self._parents[: self.n]

    @property
    def depths(self) -> np.ndarray:
        return self._depths[: self.n]

    @property
    def probs(self) -> np.ndarray:
        return self._probs[: self.n]

    @property
    def cells(self) -> list[list[int]]:
        """Each node's cells as a list (for inspection; the arrays are what the code uses)."""
        return [[c for c in row if c >= 0] for row in self._cells[: self.n].tolist()]

    def _reserve(self, extra: int) -> None:
        if self.n + extra <= len(self._tokens):
            return
        capacity = 2 * (self.n + extra)
        for name in ("_tokens", "_parents", "_depths", "_probs", "_cells", "_priors"):
            old = getattr(self, name)
            new = np.full((capacity, *old.shape[1:]), np.nan if name == "_priors" else -1, old.dtype)
            new[: self.n] = old[: self.n]
            setattr(self, name, new)

    def add_chain(self, chain: Sequence[int] | np.ndarray, probs: Sequence[float] | np.ndarray,
                  cells: Sequence[int] | np.ndarray, priors: Sequence[float] | np.ndarray | None = None) -> None:
        """Insert a continuation along a root path, sharing nodes that exist; a shared node
        keeps the higher of the two estimates and is labelled for both sources."""
        chain = np.asarray(chain, dtype=np.int64)
        if not len(chain):
            return
        self._reserve(len(chain))
        priors = np.full(len(chain), np.nan) if priors is None else np.asarray(priors, dtype=np.float64)
        new = (chain, np.asarray(probs, dtype=np.float64), np.asarray(cells, dtype=np.int64), priors)
        self.n = _add_chain(self._tokens, self._parents, self._depths, self._probs, self._cells, self._priors,
                            self.n, new)

    def scale(self, factor: float) -> None:
        """Multiply every estimate by ``factor`` (kept below 1)."""
        np.minimum(self._probs[: self.n] * factor, 0.999, out=self._probs[: self.n])

    def path_probs(self) -> np.ndarray:
        """P(node's whole path accepted) = product of the estimates from the root down."""
        return _path_probs(self._parents, self._probs, self.n)


@dataclass
class ChosenTree:
    """What a proposer keeps from its choice to learn from the verification."""

    tree: DraftTree
    probs: np.ndarray
    """Each drafted node's estimate (given its parent accepted), in tree order."""
    cell_array: np.ndarray
    """(nodes, 3) calibration cells per drafted node, -1 where a source did not offer it."""
    expected: float = 0.0
    """Expected accepted draft tokens of the tree (sum of path probabilities)."""
    prior_array: np.ndarray | None = None
    """(nodes, 3) each source's prior for the node, NaN where not given (its cell's own)."""

    @property
    def cells(self) -> list[list[int]]:
        return [[c for c in row if c >= 0] for row in self.cell_array.tolist()]

    def labelled_cells(self, labelled: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The cells of the labelled nodes, flattened, how many cells each node has, and each
        flattened cell's prior for its node (NaN: the cell's own)."""
        picked = self.cell_array[labelled]
        present = picked >= 0
        priors = np.full(picked.shape, np.nan) if self.prior_array is None else self.prior_array[labelled]
        return picked[present], present.sum(axis=1), priors[present]


def best_size(path_probs_sorted: np.ndarray, cost: CostProfile | None, context_len: int,
              cap: int | None = None) -> int:
    """How many of the sorted candidates to draft: the value-maximising prefix under ``cost``
    (no cost: all of them), at most ``cap``."""
    n_max = len(path_probs_sorted) if cap is None else min(cap, len(path_probs_sorted))
    if cost is None or n_max == 0:
        return n_max
    return int(_best_size(np.asarray(path_probs_sorted, dtype=np.float64), cost.curve(n_max + 1, context_len),
                          n_max))


@dataclass
class Ranked:
    """Candidates in drafting order (`_order`: every parent before its children), those too
    deep for the request left out: a best-first offer from which any prefix is a valid tree."""

    candidates: Candidates
    order: np.ndarray
    """Usable candidate indices, best first."""
    path: np.ndarray
    """Every candidate's path probability (indexed like the candidates)."""
    stop: np.ndarray | None = None
    """Whether each candidate's token ends the request (None: no stop tokens given)."""

    @property
    def gains(self) -> np.ndarray:
        """Path probabilities in drafting order (non-increasing): what the i-th node adds to
        the expected tokens of the step."""
        return self.path[self.order]

    def take(self, size: int) -> tuple[DraftTree, ChosenTree]:
        """The tree of the best ``size`` nodes, and what to learn from it."""
        c = self.candidates
        chosen = self.order[:size]
        tokens, parents, depths = _subtree(chosen, c._tokens, c._parents, c._depths, c.n)
        tree = DraftTree._trusted(tokens, parents, depths)
        return tree, ChosenTree(tree, c._probs[chosen], c._cells[chosen], float(self.path[chosen].sum()),
                                c._priors[chosen])


def rank(candidates: Candidates, cap: int | None = None, max_depth: int | None = None,
         stop_tokens: frozenset[int] = frozenset()) -> Ranked:
    """The candidates best first, at most ``cap`` of them, none deeper than ``max_depth``
    (what the request can still use) and none below a ``stop_tokens`` node (the request
    ends there, so nothing after it is ever committed)."""
    n = len(candidates)
    if n == 0:
        return Ranked(candidates, np.zeros(0, np.int64), np.zeros(0))
    path = candidates.path_probs()
    unusable = np.zeros(n, bool)
    if max_depth is not None:
        unusable |= candidates.depths > max_depth
    stop = None
    if stop_tokens:
        stop, below = _stops(candidates._tokens, candidates._parents,
                             np.fromiter(stop_tokens, np.int64, len(stop_tokens)), n)
        unusable |= below
    usable = n
    if unusable.any():  # sorted after every usable node (a child of an unusable node is unusable)
        path[unusable] = -1.0
        usable = n - int(unusable.sum())
    order = _order(path, candidates._depths, n)
    n_max = usable if cap is None else max(0, min(cap, usable))
    return Ranked(candidates, order[:n_max], path, stop)


def choose(candidates: Candidates, cost: CostProfile | None, context_len: int,
           cap: int | None = None, max_depth: int | None = None,
           end_aware: bool = True, stop_tokens: frozenset[int] = frozenset()) -> tuple[DraftTree, ChosenTree]:
    """The draft tree for this step (see the module docstring) and what to learn from;
    nodes deeper than ``max_depth`` (what the request can still use) or below a stop token
    are never drafted, and with ``end_aware`` a node at exactly that depth, or a stop token
    (EOS), is credited with the step it saves."""
    ranked = rank(candidates, cap, max_depth, stop_tokens)
    n_max = len(ranked.order)
    if cost is None or n_max == 0:
        return ranked.take(n_max)
    gains, curve = ranked.gains, cost.curve(n_max + 1, context_len)
    size = int(_best_size(gains, curve, n_max))
    if end_aware and (max_depth is not None or ranked.stop is not None):
        finishes = np.zeros(n_max, bool)
        if max_depth is not None:
            finishes |= candidates.depths[ranked.order] == max_depth
        if ranked.stop is not None:
            finishes |= ranked.stop[ranked.order]
        if finishes.any():
            size = int(_best_size_to_end(gains, finishes, curve, n_max, size))
    return ranked.take(size)


def share_budget(gains: Sequence[np.ndarray], fixed_rows: int, requests: int, cost: CostProfile | None,
                 context_len: int = 0, overhead: float = 0.0, prefill_rows: int = 0) -> list[int]:
    """How many nodes each request of a batched step drafts from its best-first ``gains``
    (path probabilities, non-increasing), given ``fixed_rows`` packed rows the step has
    anyway (every request's root, the trees of methods that size their own, ``prefill_rows``
    prompt rows of newcomers) and the ``requests`` in the step (each commits its bonus
    token): the counts maximising expected committed tokens per second of the step's decoding,

        (requests + sum of the chosen gains) / (t(fixed_rows + chosen) - prefill + overhead),

    ``overhead`` being what a step costs besides its forward (the same whatever its size) and
    ``prefill = t(fixed_rows) - t(fixed_rows - prefill_rows)`` the time of the prompt rows:
    work the batch does once whatever is drafted, so it must not make drafts look cheap (a
    step carrying a 32-row chunk would otherwise take nodes of half the likelihood a plain
    step takes, each still costing its row). Every node costs the same row in t, so for
    each total the best set is the largest gains over all requests (a prefix of each
    request's offer, hence valid trees): sorting the merged gains and scanning the totals
    finds the exact optimum. No cost profile: all."""
    sizes = [len(g) for g in gains]
    if cost is None or not sum(sizes):
        return sizes
    if not 0 <= prefill_rows < fixed_rows:
        raise ValueError(f"prefill_rows must be in [0, fixed_rows), got {prefill_rows} of {fixed_rows}")
    merged = np.concatenate([np.asarray(g, np.float64) for g in gains])
    owner = np.repeat(np.arange(len(gains)), sizes)
    order = np.argsort(-merged, kind="stable")  # stable: each request's own order is kept on ties
    full = cost.curve(fixed_rows + len(merged), context_len)
    prefill = full[fixed_rows - 1] - full[fixed_rows - prefill_rows - 1] if prefill_rows else 0.0
    curve = full[fixed_rows - 1:] - prefill + overhead
    total = int(_best_size(merged[order], curve, len(merged), float(requests)))
    return np.bincount(owner[order[:total]], minlength=len(gains)).tolist()


class ChosenSizes(Sequence[int]):
    """The draft size chosen at each step of a stream, bounded: a stream lives as long as the
    server, so only the latest ``window`` sizes are kept, plus running totals over the whole
    stream (``steps``, ``total``) for means over any span (`recap.bench.calibration`).

    Indexing, slicing, ``len`` and iteration see the kept window, oldest first."""

    def __init__(self, window: int = 4096):
        if window < 1:
            raise ValueError("window must be at least 1")
        self._recent: deque[int] = deque(maxlen=window)
        self.steps = 0
        """Sizes chosen since the stream began (or was cleared)."""
        self.total = 0
        """Their sum."""

    def append(self, size: int) -> None:
        self._recent.append(int(size))
        self.steps += 1
        self.total += int(size)

    def clear(self) -> None:
        self._recent.clear()
        self.steps = 0
        self.total = 0

    def __len__(self) -> int:
        return len(self._recent)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return list(self._recent)[index]
        return self._recent[index]

    def __iter__(self):
        return iter(self._recent)

    def __repr__(self) -> str:
        return f"ChosenSizes(steps={self.steps}, total={self.total}, recent={list(self._recent)[-8:]})"
