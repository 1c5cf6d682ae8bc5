"""Context-stratified prediction memory: U (1-token keys), C (2-token), G (3-token).

A *row* is the target's Top-K at one evaluated position: token ids (highest first), their
probabilities renormalised over the K kept logits, and the confidence exp(-entropy) that
fusion needs (computed once here, when the row is stored, not at every lookup).

U persists across the requests of a stream; C and G are request-local. Each key keeps its most
recently written row; within one verification batch the first occurrence of a key wins.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import numpy as np

from recap.core.steps import PromptRows, VerifiedTree

Row = tuple[tuple[int, ...], tuple[float, ...], float]
"""(ids highest first, probabilities, confidence). Plain tuples: cheap to build on the hot
path, and the garbage collector stops tracking them, so a large memory costs no GC time."""


def make_row(ids: Sequence[int], probs: Sequence[float], confidence: float | None = None) -> Row:
    """A row from explicit values; the confidence defaults to exp(-entropy(probs))."""
    if confidence is None:
        confidence = math.exp(sum(p * math.log(p) for p in probs if p > 0))
    return tuple(int(i) for i in ids), tuple(float(p) for p in probs), float(confidence)


def rows_from_logits(topk_ids: np.ndarray, topk_logits: np.ndarray) -> list[Row]:
    """Rows for a batch of Top-K logits, vectorised: softmax over the K kept logits,
    entropy, confidence = exp(-entropy)."""
    logits = np.asarray(topk_logits, dtype=np.float64)
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = shifted / shifted.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(probs > 0, probs * np.log(probs), 0.0).sum(axis=1)
    confidence = np.exp(-entropy)
    return list(zip(map(tuple, np.asarray(topk_ids).tolist()), map(tuple, probs.tolist()), confidence.tolist()))


class PredictionMemory:
    """The three maps. ``lookup(context)`` returns the rows for the last 3/2/1 tokens of a
    context, most specific first."""

    def __init__(self) -> None:
        self.unigram: dict[int, Row] = {}
        self.bigram: dict[tuple[int, int], Row] = {}
        self.trigram: dict[tuple[int, int, int], Row] = {}

    # -------------------------------------------------------------- lifecycle
    def reset_request(self) -> None:
        """C and G are request-local: the request's image and prompt condition them implicitly."""
        self.bigram.clear()
        self.trigram.clear()

    def drop_unigram(self, keys) -> None:
        """Forget U's rows of ``keys`` (eviction)."""
        for key in keys:
            self.unigram.pop(int(key), None)

    def reset_stream(self) -> None:
        self.unigram.clear()
        self.reset_request()

    # -------------------------------------------------------------- reads
    def lookup(self, u: int | None, v: int | None, x: int) -> list[Row]:
        """Rows under G[u, v, x], C[v, x], U[x] that exist, in that order. ``None`` marks a
        token before the start of the history."""
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

    def nbytes(self) -> int:
        """Bytes of Python objects the maps hold: dict tables, keys, and each row (tuple, ids,
        probabilities) counted once even when several keys share it."""
        total = sum(sys.getsizeof(table) for table in (self.unigram, self.bigram, self.trigram))
        seen: set[int] = set()
        for table in (self.unigram, self.bigram, self.trigram):
            for key, row in table.items():
                total += sys.getsizeof(key) + (sum(map(sys.getsizeof, key)) if isinstance(key, tuple) else 0)
                if id(row) not in seen:
                    seen.add(id(row))
                    ids, probs, confidence = row
                    total += sys.getsizeof(row) + sys.getsizeof(ids) + sys.getsizeof(probs) + sys.getsizeof(confidence)
                    total += sum(map(sys.getsizeof, ids)) + sum(map(sys.getsizeof, probs))
        return total

    # -------------------------------------------------------------- persistence
    def unigram_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """U as (keys [n] ascending, ids [n, K], probs [n, K]); narrower rows zero-padded."""
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
        """U[keys[i]] <- row i. Log-probabilities go through the live-row code path as logits
        (zero probabilities as -1e30), which renormalises and recomputes confidences."""
        if not len(keys):
            return
        with np.errstate(divide="ignore"):
            logits = np.log(np.asarray(probs))
        rows = rows_from_logits(ids, np.where(np.isfinite(logits), logits, -1e30))
        self.unigram.update(zip(np.asarray(keys).tolist(), rows))

    # -------------------------------------------------------------- writes
    def seed_from_prompt(self, prompt: PromptRows) -> None:
        """U[token] <- the prefill row at each eligible token's first occurrence in the prompt."""
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
        """Store the rows of every evaluated node (root, accepted and rejected) under its path
        context. ``history`` ends with the root token (its last three tokens are enough).
        First occurrence in the batch wins. ``contextual=False`` writes U only."""
        tree = step.tree
        rows = rows_from_logits(step.topk_ids, step.topk_logits)
        tokens = [history[-1], *tree.tokens.tolist()]
        # Last three path tokens per packed position: (grandparent, parent, self).
        prev1 = [history[-2] if len(history) > 1 else None]
        prev2 = [history[-3] if len(history) > 2 else None]
        for parent in tree.parents.tolist():
            prev1.append(tokens[parent + 1])
            prev2.append(prev1[parent + 1])
        # Written last to first, so the first occurrence of a key in the batch is what stays.
        unigram, bigram, trigram = self.unigram, self.bigram, self.trigram
        for x, v, u, row in zip(reversed(tokens), reversed(prev1), reversed(prev2), reversed(rows)):
            unigram[x] = row
            if contextual and v is not None:
                bigram[(v, x)] = row
                if u is not None:
                    trigram[(u, v, x)] = row
