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

from recap.core import DraftTree, VerifiedTree
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


def first_argmax(logits: torch.Tensor, values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1, keepdim=True)`` (the first index of each row's maximum) read off
    the row's Top-K (``values``, ``ids`` from `torch.topk`) instead of a second pass over the
    vocabulary. Exact: when fewer than K entries tie at the maximum, all of them are in the
    Top-K, and the first is the smallest id among them; a row whose K values all tie, or that
    holds a NaN, is recomputed with ``argmax``."""
    at_max = values == values[:, :1]
    first = torch.where(at_max, ids, torch.full_like(ids, logits.shape[-1])).min(dim=-1, keepdim=True).values
    unsure = at_max[:, -1] | torch.isnan(values[:, 0])
    if bool(unsure.any()):
        first[unsure] = logits[unsure].argmax(dim=-1, keepdim=True)
    return first


def top_rows(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-K ids / logits and the argmax of each row, computed on the device and moved to the
    host in a single transfer (ids are exact in float64)."""
    values, ids = torch.topk(logits, k, dim=-1)
    argmax = first_argmax(logits, values, ids)
    packed = torch.cat([ids.double(), values.double(), argmax.double()], dim=1).cpu().numpy()
    return packed[:, :k].astype(np.int64), packed[:, k : 2 * k].astype(np.float32), packed[:, 2 * k].astype(np.int64)


def verified(tree: DraftTree, logits: torch.Tensor, k: int, sampler: Sampler | None = None, position: int = 0,
             image_attention: float | None = None) -> VerifiedTree:
    """One verification from the logits (N, V) of [root] + the tree's nodes: their Top-K rows,
    the accepted path (`greedy`, or `sampled` with ``sampler``) and each reached row's token."""
    ids, topk_logits, argmax = top_rows(logits, k)
    if sampler is None:
        accepted = greedy(tree, argmax)
    else:
        accepted, draws = sampled(tree, logits, sampler, position)
        for row, token in draws.items():
            argmax[row] = token
    return VerifiedTree(tree=tree, topk_ids=ids, topk_logits=topk_logits, argmax=argmax, accepted=accepted,
                        image_attention=image_attention)
