"""One forward over several requests' draft trees: what continuous batching steps with.

Every lane (`TargetModel.fork`) holds one request's KV cache. On the fast kernels the lanes'
packed trees are concatenated into one step (`FastDecoder.forward_batch`): the linear layers
read the weights once for all rows, attention stays inside each request's own cache, and
since every kernel is batch-invariant a request's logits are bit-identical to verifying it
alone. A newcomer's prefill chunk rides in the same forward as a chain of rows. Lanes on the
stock transformers path are verified one after another (batch of one).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from recap.core import DraftTree, VerifiedTree
from recap.verifier.kernels.prefix import ChunkedPrefill
from recap.verifier.protocol import Target
from recap.verifier.sampling import Sampler


def can_batch(lanes: Sequence[Target]) -> bool:
    """Whether these lanes can share one forward: each one the first lane says it shares its
    forward with (`TargetModel.shares_forward_with`: lanes holding a request on the same
    model's fast kernels); any other `Target` is verified on its own."""
    first = lanes[0] if lanes else None
    shares = getattr(first, "shares_forward_with", None)
    return shares is not None and all(shares(lane) for lane in lanes)


def _embeds(vectors: np.ndarray | None) -> list[tuple[int, np.ndarray]]:
    return [] if vectors is None else [(0, vectors)]


def _positions(parts: Sequence[np.ndarray]) -> np.ndarray:
    """The step's positions: (M,), or (M, 3) once an image prompt's M-RoPE chunk rides along
    (a text row's three coordinates are equal)."""
    if all(part.ndim == 1 for part in parts):
        return np.concatenate(parts)
    return np.concatenate([part if part.ndim == 2 else np.repeat(part[:, None], 3, axis=1) for part in parts])


def _logit_rows(bounds: np.ndarray, trees: int, prefills: Sequence[ChunkedPrefill]) -> np.ndarray | None:
    """The step's rows whose logits are read: every tree row, and of each prefill chunk the
    rows it asks for (`ChunkedPrefill.logit_rows`); None: all rows."""
    wanted = [chunked.logit_rows() for chunked in prefills]
    if all(rows is None for rows in wanted):
        return None
    parts = [np.arange(bounds[trees], dtype=np.int64)]
    for r, rows in enumerate(wanted, start=trees):
        parts.append(np.arange(bounds[r], bounds[r + 1], dtype=np.int64) if rows is None else rows + bounds[r])
    return np.concatenate(parts)


@torch.inference_mode()
def verify_batch(lanes: Sequence[Target], roots: Sequence[int], trees: Sequence[DraftTree],
                 samplers: Sequence[Sampler | None], positions: Sequence[int],
                 prefills: Sequence[tuple[ChunkedPrefill, int]] = ()) -> list[VerifiedTree]:
    """``lane.verify(root, tree, sampler, position)`` for every lane, in one forward where
    the lanes `can_batch`; each lane then commits (or not) on its own. ``prefills`` (a
    newcomer's `ChunkedPrefill` and its rows this step) ride in the same forward as chains."""
    if len({id(lane) for lane in lanes} | {id(p.lane) for p, _ in prefills}) != len(lanes) + len(prefills):
        raise ValueError("a lane appears twice in one batch")
    if not can_batch([*lanes, *(p.lane for p, _ in prefills)]):
        for chunked, budget in prefills:
            rows = chunked.rows(budget)
            chunked.absorb(chunked.lane._fast.forward(chunked.lane._kv, *rows, _embeds(chunked.embeds()),
                                                      chunked.logit_rows()))
        return [lane.verify(root, tree, sampler, position)
                for lane, root, tree, sampler, position in zip(lanes, roots, trees, samplers, positions)]
    parts = [lane._fast_rows(root, tree) for lane, root, tree in zip(lanes, roots, trees)]
    parts += [chunked.rows(budget) for chunked, budget in prefills]
    caches = [lane._kv for lane in lanes] + [chunked.lane._kv for chunked, _ in prefills]
    bounds = np.zeros(len(parts) + 1, np.int64)
    np.cumsum([len(tokens) for tokens, *_ in parts], out=bounds[1:])
    path_offsets = np.cumsum([0] + [len(paths) for *_, paths in parts])
    starts = np.concatenate([[0]] + [part[2][1:] + offset for part, offset in zip(parts, path_offsets)])
    embeds = [(int(bounds[r]), vectors) for r, (chunked, _) in enumerate(prefills, start=len(lanes))
              if (vectors := chunked.embeds()) is not None]
    fast = (lanes[0] if lanes else prefills[0][0].lane)._fast
    logits = fast.forward_batch(caches, np.concatenate([part[0] for part in parts]),
                                _positions([part[1] for part in parts]), bounds, starts.astype(np.int64),
                                np.concatenate([part[3] for part in parts]), embeds,
                                _logit_rows(bounds, len(lanes), [chunked for chunked, _ in prefills]))
    for r, (chunked, _) in enumerate(prefills, start=len(lanes)):
        chunked.absorb(logits[bounds[r]:bounds[r + 1]], int(bounds[r]))
    return [lane._fast_verified(tree, logits[bounds[r]:bounds[r + 1]], int(bounds[r]), sampler, position)
            for r, (lane, tree, sampler, position) in enumerate(zip(lanes, trees, samplers, positions))]
