"""Prompt Lookup Decoding (PLD): copy what followed the last n-gram earlier in the context.

Keys are the last 1..4 committed tokens, longest first; the most recent earlier occurrence
with a continuation wins, and up to 10 following tokens become a chain draft. An n-gram
index over prompt + output grows incrementally, so each step costs O(new tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

from recap.core import DraftTree, PromptRows, StepLimits
from recap.proposers.base import BaseProposer


class PromptLookupProposer(BaseProposer):
    name = "pld"
    rows_wanted = "none"

    def __init__(self, *, max_ngram: int = 4, max_draft: int = 10):
        self.max_ngram = max_ngram
        self.max_draft = max_draft
        self._index: list[dict[tuple[int, ...], int]] = []
        self._indexed = 0

    def begin_request(self, prompt: PromptRows) -> None:
        self.prompt = prompt
        self._index = [{} for _ in range(self.max_ngram + 1)]
        self._indexed = 0

    def propose(self, history: Sequence[int], limits: StepLimits | None = None) -> DraftTree:
        # Index every n-gram that ends before the last token (so it has a continuation).
        for end in range(self._indexed, len(history) - 1):
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self._index[n][tuple(history[end - n + 1 : end + 1])] = end
        self._indexed = max(self._indexed, len(history) - 1)
        for n in range(min(self.max_ngram, len(history)), 0, -1):
            end = self._index[n].get(tuple(history[len(history) - n :]))
            if end is not None:
                draft = []
                for token in history[end + 1 : end + 1 + self.max_draft]:
                    if token in self.prompt.excluded_tokens:
                        break
                    draft.append(token)
                return DraftTree(draft, list(range(-1, len(draft) - 1)))
        return DraftTree.empty()
