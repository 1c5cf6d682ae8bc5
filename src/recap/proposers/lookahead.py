"""Lookahead (Zhao et al. 2023): multi-branch drafts from a trie of prompt and output n-grams.

The paper's settings: decoding length 64, branch length 12. In the framework the decoding
length counts the root (the last committed token), so a draft has at most 63 nodes, the same
budget as RECAP's 63 candidates; each branch is at most 12 tokens deep.

Scope, as in the framework (one ``LookaheadCache`` per model): the trie is **stream-persistent**.
Output n-grams (including the prompt tail + answer boundary) accumulate over the requests of a
stream, with their counts; the prompt's n-grams are request-local, counted separately so they
rank first during their request, and removed at ``end_request``. ``reset_stream`` empties the
trie. The retrieval and insertion rules live in `recap.core.trie.NGramTrie`.
"""

from __future__ import annotations

from collections.abc import Sequence

from recap.core import DraftTree, PromptRows, StepLimits, VerifiedTree
from recap.core.trie import NGramTrie
from recap.proposers.base import BaseProposer


class LookaheadProposer(BaseProposer):
    name = "lookahead"
    rows_wanted = "none"
    stream_state = True

    def __init__(self, *, decoding_length: int = 64, branch_length: int = 12, max_prefix: int = 2):
        if decoding_length < 1:
            raise ValueError(f"decoding_length counts the root and must be at least 1, got {decoding_length}")
        self.budget = decoding_length - 1
        self.trie = NGramTrie(branch_length=branch_length, max_prefix=max_prefix)
        self._synced = 0

    def begin_request(self, prompt: PromptRows) -> None:
        self.prompt = prompt
        self.trie.begin_request(prompt.ids.tolist(), prompt.excluded_tokens)
        self._synced = len(prompt.ids)

    def propose(self, history: Sequence[int], limits: StepLimits | None = None) -> DraftTree:
        # Tokens committed without an observe (the prefill's first token) enter the trie here.
        if len(history) > self._synced:
            self.trie.extend_output(history[self._synced :])
            self._synced = len(history)
        return self.trie.draft(history, self.budget)

    def observe(self, step: VerifiedTree) -> None:
        committed = step.committed
        self.trie.extend_output(committed)
        self._synced += len(committed)

    def end_request(self) -> None:
        self.trie.end_request()

    def reset_stream(self) -> None:
        self.trie.clear()
        self._synced = 0
