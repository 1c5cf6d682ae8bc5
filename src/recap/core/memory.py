"""Context-stratified prediction memory: U (1-token keys), C (2-token), G (3-token).

A *row* is the target's Top-K at one evaluated position: token ids (highest first), their
probabilities renormalised over the K kept logits, and the confidence exp(-entropy) that
fusion needs (computed once here, when the row is stored, not at every lookup).

U persists across the requests of a stream; C and G are request-local. Each key keeps its most
recently written row; within one verification batch the first occurrence of a key wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recap.core.steps import PromptRows, VerifiedTree


@dataclass(frozen=True, slots=True)
class Row:
    ids: tuple[int, ...]
    probs: tuple[float, ...]
    confidence: float


def rows_from_logits(topk_ids: np.ndarray, topk_logits: np.ndarray) -> list[Row]:
    """Rows for a batch of Top-K logits, vectorised: softmax over the K kept logits,
    entropy, confidence = exp(-entropy)."""
    logits = np.asarray(topk_logits, dtype=np.float64)
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = shifted / shifted.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(probs > 0, probs * np.log(probs), 0.0).sum(axis=1)
    confidence = np.exp(-entropy)
    return [Row(tuple(i), tuple(p), c)
            for i, p, c in zip(np.asarray(topk_ids).tolist(), probs.tolist(), confidence.tolist())]


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
        """Approximate payload size: K ids (int32) + K probs (float32) + confidence per row,
        plus the key tokens (int32)."""
        total = 0
        for table, key_len in ((self.unigram, 1), (self.bigram, 2), (self.trigram, 3)):
            for row in table.values():
                total += 8 * len(row.ids) + 4 + 4 * key_len
        return total

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

    def refresh(self, history: list[int], step: VerifiedTree, *, unigram: bool = True, contextual: bool = True) -> None:
        """Store the rows of every evaluated node (root, accepted and rejected) under its path
        context. ``history`` ends with the root token. First occurrence in the batch wins."""
        tree = step.tree
        rows = rows_from_logits(step.topk_ids, step.topk_logits)
        tokens = [history[-1], *tree.tokens.tolist()]
        # Last three path tokens per packed position: (grandparent, parent, self).
        prev1 = [history[-2] if len(history) > 1 else None]
        prev2 = [history[-3] if len(history) > 2 else None]
        for parent in tree.parents.tolist():
            prev1.append(tokens[parent + 1])
            prev2.append(prev1[parent + 1])
        seen_u: set[int] = set()
        seen_c: set[tuple[int, int]] = set()
        seen_g: set[tuple[int, int, int]] = set()
        for x, v, u, row in zip(tokens, prev1, prev2, rows):
            if unigram and x not in seen_u:
                seen_u.add(x)
                self.unigram[x] = row
            if contextual and v is not None:
                key2 = (v, x)
                if key2 not in seen_c:
                    seen_c.add(key2)
                    self.bigram[key2] = row
                if u is not None:
                    key3 = (u, v, x)
                    if key3 not in seen_g:
                        seen_g.add(key3)
                        self.trigram[key3] = row
