"""What Token Recycling and Tree Recycling share: a static template filled from an adjacency
matrix, and a refresh that writes every verified position's row under its own token.

Subclasses choose the matrix (persistent or request-local, what an empty row means), the
duplicate rule of a refresh, and what `begin_request` seeds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from recap.core import DraftTree, PromptRows, StepLimits, VerifiedTree
from recap.core.adjacency import AdjacencyMatrix
from recap.core.static_tree import StaticTreeTemplate
from recap.errors import InputError
from recap.proposers.base import BaseProposer


class RecyclingProposer(BaseProposer):
    """Static-tree drafting from a token-indexed Top-``top_k`` matrix."""

    first_wins = False
    """Within one refresh, does the first (else the last) packed position of a token win?"""

    def __init__(self, template: StaticTreeTemplate, top_k: int):
        if template.max_rank >= top_k:
            raise InputError(f"the tree template uses rank {template.max_rank}, beyond the Top-{top_k} rows")
        self.template = template
        self.top_k = top_k
        self.matrix: AdjacencyMatrix | None = None  # sized at the first request, when the vocabulary is known
        self._excluded: frozenset[int] | None = None
        self._excluded_mask: np.ndarray | None = None
        self._root: int | None = None

    def new_matrix(self, vocab_size: int) -> AdjacencyMatrix:
        raise NotImplementedError

    def begin_request(self, prompt: PromptRows) -> None:
        """Check the rows are wide enough, size the matrix to the vocabulary (a new vocabulary
        means a new stream) and note the tokens that must never be drafted."""
        k = prompt.topk_ids.shape[1]
        if k < self.top_k:
            raise InputError(f"{self.name} needs the target's Top-{self.top_k} rows, but it gives Top-{k}; "
                             f"load the target with top_k >= {self.top_k}")
        self.prompt = prompt
        if self.matrix is None or self.matrix.vocab_size != prompt.vocab_size:
            self.matrix = self.new_matrix(prompt.vocab_size)
        if prompt.excluded_tokens != self._excluded:
            self._excluded = prompt.excluded_tokens
            self._excluded_mask = None
            if self._excluded:
                self._excluded_mask = np.zeros(prompt.vocab_size, dtype=bool)
                self._excluded_mask[[t for t in self._excluded if 0 <= t < prompt.vocab_size]] = True
        self._root = None

    def propose(self, history: Sequence[int], limits: StepLimits | None = None) -> DraftTree:
        self._root = int(history[-1])
        return self.template.expand(self._root, self.matrix.next_tokens, self._excluded_mask)

    def observe(self, step: VerifiedTree) -> None:
        """Every verified position (root = the last token at propose time, then every node,
        accepted or not) writes its Top-``top_k`` row under its own token."""
        if self._root is None:
            raise RuntimeError("observe() before propose()")
        tokens = np.empty(len(step.tree) + 1, dtype=np.int64)
        tokens[0] = self._root
        tokens[1:] = step.tree.tokens
        self.matrix.write(tokens, step.topk_ids, first_wins=self.first_wins)
        self._root = None

    def end_request(self) -> None:
        self._root = None

    def reset_stream(self) -> None:
        """Forget every row."""
        if self.matrix is not None:
            self.matrix.reset()
