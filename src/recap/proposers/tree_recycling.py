"""Tree Recycling: the RECAP paper's lighter token-indexed baseline.

A static full tree of width 2 and depth 4 (2 + 4 + 8 + 16 = 30 candidates, 31 packed nodes
with the root) is expanded from a *request-local* |V| x 4 adjacency matrix. The paper fixes
only that much; the rest is this implementation's choice, made to match RECAP's own
request-local memories so the comparison isolates the static tree and the single-token key:

- Seeding: at `begin_request` the matrix is emptied, then each eligible prompt token (not an
  image placeholder or special token) stores the prefill row at its first occurrence, exactly
  as RECAP seeds U.
- Refresh: every verified position (root and all nodes) writes its Top-4 under its token;
  within one verification the first occurrence of a token wins, across verifications the
  newer row replaces the older (RECAP's refresh rule).
- Unknown rows: a token with no row yet has no children, so its subtree is dropped (drafting
  "token 0" from an empty row would only waste verification slots). Nodes whose token is in
  ``prompt.excluded_tokens`` are dropped with their subtrees too.
"""

from __future__ import annotations

import numpy as np

from recap.core import PromptRows, first_eligible, rows_at
from recap.core.adjacency import UNKNOWN, AdjacencyMatrix
from recap.core.static_tree import StaticTreeTemplate
from recap.errors import InputError
from recap.proposers.recycling import RecyclingProposer


class TreeRecyclingProposer(RecyclingProposer):
    """Tree Recycling: request-local Top-4 matrix, static full tree of width 2, depth 4."""

    name = "tree-recycling"
    first_wins = True
    rows_wanted = "first"  # seeded from each eligible prompt token's first row

    def __init__(self, *, width: int = 2, depth: int = 4, top_k: int = 4):
        if not 1 <= width <= top_k:
            raise InputError(f"width must be between 1 and top_k ({top_k}), got {width}")
        super().__init__(StaticTreeTemplate.full(width, depth), top_k)

    def new_matrix(self, vocab_size: int) -> AdjacencyMatrix:
        # Empty rows are UNKNOWN (no children); resets only touch the rows written.
        return AdjacencyMatrix(vocab_size, self.top_k, fill=UNKNOWN, track_writes=True)

    def begin_request(self, prompt: PromptRows) -> None:
        """Empty the matrix, then seed it from the eligible prompt rows (first occurrence)."""
        super().begin_request(prompt)
        self.matrix.reset()
        positions = first_eligible(prompt.ids, prompt.eligible)
        self.matrix.write(np.asarray(prompt.ids)[positions], rows_at(prompt.topk_ids, prompt.topk_logits, positions)[0],
                          first_wins=True)

    def end_request(self) -> None:
        """The matrix is request-local: drop its rows now."""
        super().end_request()
        if self.matrix is not None:
            self.matrix.reset()
