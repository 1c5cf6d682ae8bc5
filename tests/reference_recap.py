"""The readable pure-Python RECAP: the oracle the compiled engine is tested against.

RECAP ships one engine, `recap.core.fast` (numba). This module is what that engine must
reproduce bit for bit: the U/C/G prediction memory (`PredictionMemory`), the entropy-
confidence fusion (`fuse`) and the best-first tree search (`ReferenceSearch`). It lives
under tests/ because nothing in the library runs it; `tests/test_fast.py` compares the two
on random workloads and `tests/test_recap_core.py` pins both to hand-computed cases.

Contexts here pad the start of the history with ``None`` (the compiled engine uses -1);
that convention never leaves this file.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from operator import itemgetter

import numpy as np

from recap.core import ROOT, PromptRows, TreeBuilder, VerifiedTree
from recap.core.fast import FastMemory
from recap.proposers.recap import RecapConfig

Row = tuple[tuple[int, ...], tuple[float, ...], float]
"""(ids highest first, probabilities, confidence). Plain tuples, as the original engine kept
them (the garbage collector stops tracking them)."""


# ----------------------------------------------------------------------------- rows
def make_row(ids: Sequence[int], probs: Sequence[float], confidence: float | None = None) -> Row:
    """A row from explicit values; the confidence defaults to exp(-entropy(probs))."""
    if confidence is None:
        confidence = math.exp(sum(p * math.log(p) for p in probs if p > 0))
    return tuple(int(i) for i in ids), tuple(float(p) for p in probs), float(confidence)


def rows_from_logits(topk_ids: np.ndarray, topk_logits: np.ndarray) -> list[Row]:
    """Rows for a batch of Top-K logits: softmax over the K kept logits, entropy, confidence
    = exp(-entropy). The compiled engine uses these same numpy expressions (same bits)."""
    logits = np.asarray(topk_logits, dtype=np.float64)
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = shifted / shifted.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(probs > 0, probs * np.log(probs), 0.0).sum(axis=1)
    confidence = np.exp(-entropy)
    return list(zip(map(tuple, np.asarray(topk_ids).tolist()), map(tuple, probs.tolist()), confidence.tolist()))


def plant_unigram(memory: FastMemory, rows: Mapping[int, Row]) -> None:
    """Write hand-made rows into the compiled memory's U (for tests that plant rows).

    Through `FastMemory.load_unigram`, as a memory file is installed: probabilities are
    renormalised and confidences recomputed from them (a row's own confidence is not kept).
    Rows are grouped by width so each keeps its own length."""
    by_width: dict[int, list[tuple[int, Row]]] = {}
    for key, row in rows.items():
        by_width.setdefault(len(row[0]), []).append((int(key), row))
    for group in by_width.values():
        keys = np.array([key for key, _ in group], dtype=np.int64)
        ids = np.array([row[0] for _, row in group], dtype=np.int64)
        probs = np.array([row[1] for _, row in group], dtype=np.float64)
        memory.load_unigram(keys, ids, probs)


# ----------------------------------------------------------------------------- memory
class PredictionMemory:
    """U (1-token keys), C (2-token), G (3-token): each key keeps its most recently written
    row; within one verification batch the first occurrence of a key wins."""

    def __init__(self) -> None:
        self.unigram: dict[int, Row] = {}
        self.bigram: dict[tuple[int, int], Row] = {}
        self.trigram: dict[tuple[int, int, int], Row] = {}

    def reset_request(self) -> None:
        self.bigram.clear()
        self.trigram.clear()

    def reset_stream(self) -> None:
        self.unigram.clear()
        self.reset_request()

    def lookup(self, u: int | None, v: int | None, x: int) -> list[Row]:
        """Rows under G[u, v, x], C[v, x], U[x] that exist, most specific first."""
        rows = []
        if u is not None:
            row = self.trigram.get((u, v, x))
            if row is not None:
                rows.append(row)
        if v is not None:
            row = self.bigram.get((v, x))
            if row is not None:
                rows.append(row)
        row = self.unigram.get(x)
        if row is not None:
            rows.append(row)
        return rows

    def __len__(self) -> int:
        return len(self.unigram) + len(self.bigram) + len(self.trigram)

    def unigram_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """U as (keys ascending, ids, probs), narrower rows zero-padded (the file layout)."""
        keys = np.array(sorted(self.unigram), dtype=np.int64)
        width = max((len(row[0]) for row in self.unigram.values()), default=0)
        ids = np.zeros((len(keys), width), dtype=np.int64)
        probs = np.zeros((len(keys), width), dtype=np.float64)
        for i, key in enumerate(keys.tolist()):
            row_ids, row_probs, _ = self.unigram[key]
            ids[i, : len(row_ids)] = row_ids
            probs[i, : len(row_probs)] = row_probs
        return keys, ids, probs

    def load_unigram(self, keys: np.ndarray, ids: np.ndarray, probs: np.ndarray) -> None:
        """U[keys[i]] <- row i, log-probabilities treated as logits (zeros as -1e30)."""
        if not len(keys):
            return
        with np.errstate(divide="ignore"):
            logits = np.log(np.asarray(probs))
        rows = rows_from_logits(ids, np.where(np.isfinite(logits), logits, -1e30))
        self.unigram.update(zip(np.asarray(keys).tolist(), rows))

    def seed_from_prompt(self, prompt: PromptRows) -> None:
        """U[token] <- the prefill row at each eligible token's first occurrence."""
        first: dict[int, int] = {}
        for position, (token, eligible) in enumerate(zip(prompt.ids.tolist(), prompt.eligible.tolist())):
            if eligible and token not in first:
                first[token] = position
        if not first:
            return
        positions = np.fromiter(first.values(), dtype=np.int64, count=len(first))
        rows = rows_from_logits(prompt.topk_ids[positions], prompt.topk_logits[positions])
        self.unigram.update(zip(first.keys(), rows))

    def refresh(self, history: Sequence[int], step: VerifiedTree, *, contextual: bool = True) -> None:
        """Every evaluated node's row (root, accepted and rejected) under its path context;
        ``history`` ends with the root token. ``contextual=False`` writes U only."""
        tree = step.tree
        rows = rows_from_logits(step.topk_ids, step.topk_logits)
        tokens = [history[-1], *tree.tokens.tolist()]
        prev1 = [history[-2] if len(history) > 1 else None]
        prev2 = [history[-3] if len(history) > 2 else None]
        for parent in tree.parents.tolist():
            prev1.append(tokens[parent + 1])
            prev2.append(prev1[parent + 1])
        # Written last to first, so the first occurrence of a key in the batch is what stays.
        for x, v, u, row in zip(reversed(tokens), reversed(prev1), reversed(prev2), reversed(rows)):
            self.unigram[x] = row
            if contextual and v is not None:
                self.bigram[(v, x)] = row
                if u is not None:
                    self.trigram[(u, v, x)] = row


# ----------------------------------------------------------------------------- fusion
def _top(tokens: Sequence[int], probs: Sequence[float], k: int) -> tuple[Sequence[int], Sequence[float]]:
    if len(tokens) <= k:
        return tokens, probs  # stored rows are already normalised
    total = sum(probs[:k])
    return tokens[:k], [p / total for p in probs[:k]]


def fuse(rows: Sequence[Row], k: int = 8, mode: str = "entropy",
         priors: Sequence[float] = (0.70, 0.20, 0.10)) -> tuple[Sequence[int], Sequence[float]]:
    """Fused proposal q(. | h): up to ``k`` tokens with probabilities, highest first; no rows,
    nothing (expansion ends there). Modes as `recap.core.fast.FUSION_MODES`."""
    if not rows:
        return (), ()
    if len(rows) == 1 or mode in ("backoff", "unigram"):
        return _top(rows[0][0], rows[0][1], k)
    if mode == "gate":
        best = max(range(len(rows)), key=lambda j: (rows[j][2], -j))
        return _top(rows[best][0], rows[best][1], k)
    use_prior = mode in ("entropy", "no-confidence")
    use_confidence = mode in ("entropy", "no-prior")
    weights = [(priors[j] if use_prior else 1.0) * (row[2] if use_confidence else 1.0) for j, row in enumerate(rows)]
    norm = sum(weights)
    mixture: dict[int, float] = {}
    for weight, (ids, probs, _) in zip(weights, rows):
        w = weight / norm
        for token, p in zip(ids, probs):
            mixture[token] = mixture.get(token, 0.0) + w * p
    # Stable sort: equal masses keep first-seen order, i.e. the more specific row's order.
    ranked = sorted(mixture.items(), key=itemgetter(1), reverse=True)[:k]
    total = sum(p for _, p in ranked)
    return [t for t, _ in ranked], [p / total for _, p in ranked]


# ----------------------------------------------------------------------------- tree search
class ReferenceSearch:
    """RECAP's best-first tree over a `PredictionMemory` under ``config``, as
    `FastMemory.build_tree` must compute it: path score prod_j eta_j q(z_j | h_j), children
    sorted by q, one pending child per expanded node on the heap, ties by push order."""

    def __init__(self, config: RecapConfig, memory: PredictionMemory | None = None,
                 excluded: frozenset[int] = frozenset()):
        self.config = config
        self.memory = memory if memory is not None else PredictionMemory()
        self.excluded = excluded
        self.etas = [0.0] + [config.depth_prior(d) for d in range(1, config.max_depth + 1)]
        self._cache: dict[tuple, tuple] = {}

    def fused(self, u: int | None, v: int | None, x: int) -> tuple[Sequence[int], Sequence[float]]:
        """q(. | ..., u, v, x): lookup and fusion, excluded tokens dropped (not
        renormalised), each token once, at most ``width``; memoised within one search."""
        key = (u, v, x)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        config = self.config
        if config.fusion == "unigram":
            row = self.memory.unigram.get(x)
            rows = [row] if row is not None else []
        else:
            rows = self.memory.lookup(u, v, x)
        tokens, probs = fuse(rows, config.top_k, config.fusion, config.priors)
        if (self.excluded and not self.excluded.isdisjoint(tokens)) or len(set(tokens)) < len(tokens):
            seen: set[int] = set()
            kept = []
            for t, p in zip(tokens, probs):
                if t not in self.excluded and t not in seen:
                    seen.add(t)
                    kept.append((t, p))
            tokens, probs = [t for t, _ in kept], [p for _, p in kept]
        if len(tokens) > config.width:
            tokens, probs = tokens[: config.width], probs[: config.width]
        self._cache[key] = (tokens, probs)
        return tokens, probs

    def build_tree(self, context: Sequence[int]) -> tuple[TreeBuilder, list[float]]:
        """(tree, q): the best ``budget`` nodes, q the fused probability of each node's token
        under its parent's context."""
        config, etas = self.config, self.etas
        self._cache.clear()
        padded = [None, None, *context][-3:]
        root_context = (padded[0], padded[1], padded[2])
        builder = TreeBuilder()
        qs: list[float] = []
        heap: list[tuple] = []
        tokens, probs = self.fused(*root_context)
        if tokens:
            heap.append((-etas[1] * probs[0], 0, ROOT, root_context, 0, 1.0, 1, tokens, probs))
        counter = 0
        while heap and len(builder.tokens) < config.budget:
            negative, _, parent, parent_context, index, parent_score, depth, tokens, probs = heapq.heappop(heap)
            token = tokens[index]
            known = len(builder.tokens)
            node = builder.add(parent, token)
            if len(builder.tokens) > known:
                qs.append(probs[index])
            counter += 1
            if index + 1 < len(tokens):
                sibling = parent_score * etas[depth] * probs[index + 1]
                heapq.heappush(heap, (-sibling, counter, parent, parent_context, index + 1, parent_score, depth,
                                      tokens, probs))
            if depth < config.max_depth:
                child_context = (parent_context[1], parent_context[2], token)
                child_tokens, child_probs = self.fused(*child_context)
                if child_tokens:
                    counter += 1
                    score = -negative
                    heapq.heappush(heap, (-score * etas[depth + 1] * child_probs[0], counter, node, child_context, 0,
                                          score, depth + 1, child_tokens, child_probs))
        return builder, qs

