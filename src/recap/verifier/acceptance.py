"""The acceptance rule: which drafted nodes a verification keeps. It is the one thing that
makes decoding lossless, so it is written once, here, and every verifier (stock and fast
kernels, the batched step, the model-free overhead harness) calls it.

From the root, the target picks a token at each reached row (its argmax, or a sampled draw
at that row's output position); the walk moves to the child holding that token while there
is one. The nodes it passes are accepted; the pick at the last reached row is the step's own
(bonus) token. Greedy and sampled decoding differ only in how a row's token is picked.

Negative controls patch `greedy` or `sampled` on this module (`tests/broken_verifiers.py`),
so callers reach them through the module, never by name-import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from recap.core import DraftTree
from recap.verifier.sampling import Sampler


def walk(tree: DraftTree, pick: Callable[[int, int], int]) -> tuple[list[int], dict[int, int]]:
    """The walk over one verification's packed rows: ``pick(row, depth)`` is the target's
    token after packed row ``row`` (the root's is 0) at ``depth`` accepted nodes. Returns the
    accepted nodes (root excluded) and the token picked at each reached row."""
    children = tree.children()
    accepted: list[int] = []
    picked: dict[int, int] = {}
    row = 0
    while True:
        picked[row] = token = int(pick(row, len(accepted)))
        child = children[row].get(token)
        if child is None:
            return accepted, picked
        accepted.append(child)
        row = child + 1


def greedy(tree: DraftTree, argmax: Sequence[int] | np.ndarray) -> list[int]:
    """Greedy acceptance: the accepted nodes when each row's token is its argmax."""
    return walk(tree, lambda row, depth: argmax[row])[0]


def sampled(tree: DraftTree, logits: torch.Tensor, sampler: Sampler, position: int) -> tuple[list[int], dict[int, int]]:
    """Sampled acceptance: at each reached row a draw from the target's distribution at that
    row's output position (``position`` + depth), exactly as plain sampling would draw it
    (`Sampler.token`). Returns the accepted nodes and the draw at each reached row."""
    return walk(tree, lambda row, depth: sampler.token(logits[row], position + depth))
