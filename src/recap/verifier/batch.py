"""One forward over several requests' draft trees: what continuous batching steps with.

Every lane (`TargetModel.fork`) holds one request's KV cache (`recap.verifier.fast.FastLane`).
On the fast kernels the lanes' packed trees are concatenated into one step
(`FastDecoder.forward_batch`): the linear layers read the weights once for all rows,
attention stays inside each request's own cache, and since every kernel is batch-invariant a
request's logits are bit-identical to verifying it alone. A newcomer's prefill chunk rides in
the same forward as a chain of rows. Lanes on the stock transformers path are verified one
after another (batch of one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from recap.core import DraftTree, VerifiedTree
from recap.verifier.protocol import Target
from recap.verifier.sampling import Sampler

if TYPE_CHECKING:
    from recap.verifier.kernels.prefix import ChunkedPrefill


@dataclass
class StepRequest:
    """One running request's part of a step: its lane, the root (the last token, not cached
    yet) and the tree to verify after it; with a sampler, the output position the root's row
    predicts."""

    target: Target
    root: int
    tree: DraftTree
    sampler: Sampler | None = None
    position: int = 0


@dataclass
class StepBatch:
    """Everything one forward verifies: the running requests' trees and the newcomers'
    prefill chunks (each `ChunkedPrefill` with its rows this step)."""

    requests: list[StepRequest] = field(default_factory=list)
    prefills: list[tuple[ChunkedPrefill, int]] = field(default_factory=list)

    @property
    def packed(self) -> int:
        """Rows the forward runs: each tree with its root, and the prefill chunks."""
        return sum(len(r.tree) + 1 for r in self.requests) + self.prefill_rows

    @property
    def prefill_rows(self) -> int:
        """Rows of the prefill chunks."""
        return sum(rows for _, rows in self.prefills)

    def targets(self) -> list[Target]:
        return [r.target for r in self.requests] + [chunked.lane.target for chunked, _ in self.prefills]


def can_batch(lanes: Sequence[Target]) -> bool:
    """Whether these lanes can share one forward: each one the first lane says it shares its
    forward with (`TargetModel.shares_forward_with`: lanes holding a request on the same
    model's fast kernels); any other `Target` is verified on its own."""
    first = lanes[0] if lanes else None
    shares = getattr(first, "shares_forward_with", None)
    return shares is not None and all(shares(lane) for lane in lanes)


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
def verify_batch(batch: StepBatch) -> list[VerifiedTree]:
    """``target.verify(root, tree, sampler, position)`` for every request, in one forward where
    the lanes `can_batch`; each lane then commits (or not) on its own. The prefill chunks
    ride in the same forward as chains."""
    targets = batch.targets()
    if len({id(target) for target in targets}) != len(targets):
        raise ValueError("a lane appears twice in one batch")
    if not can_batch(targets):
        for chunked, budget in batch.prefills:
            chunked.lane.run_chunk(chunked, budget)
        return [r.target.verify(r.root, r.tree, r.sampler, r.position) for r in batch.requests]
    lanes = [r.target.lane for r in batch.requests]
    prefills = [chunked for chunked, _ in batch.prefills]
    parts = [lane.step_rows(r.root, r.tree) for lane, r in zip(lanes, batch.requests)]
    parts += [chunked.rows(budget) for chunked, budget in batch.prefills]
    caches = [lane.kv for lane in lanes] + [chunked.lane.kv for chunked in prefills]
    bounds = np.zeros(len(parts) + 1, np.int64)
    np.cumsum([len(tokens) for tokens, *_ in parts], out=bounds[1:])
    path_offsets = np.cumsum([0] + [len(paths) for *_, paths in parts])
    starts = np.concatenate([[0]] + [part[2][1:] + offset for part, offset in zip(parts, path_offsets)])
    embeds = [(int(bounds[r]), vectors) for r, chunked in enumerate(prefills, start=len(lanes))
              if (vectors := chunked.embeds()) is not None]
    decoder = (lanes[0] if lanes else prefills[0].lane).decoder
    logits = decoder.forward_batch(caches, np.concatenate([part[0] for part in parts]),
                                   _positions([part[1] for part in parts]), bounds, starts.astype(np.int64),
                                   np.concatenate([part[3] for part in parts]), embeds,
                                   _logit_rows(bounds, len(lanes), prefills))
    for r, chunked in enumerate(prefills, start=len(lanes)):
        chunked.absorb(logits[bounds[r]:bounds[r + 1]], int(bounds[r]))
    return [lane.verified(request.tree, logits[bounds[r]:bounds[r + 1]], int(bounds[r]), request.sampler,
                          request.position)
            for r, (lane, request) in enumerate(zip(lanes, batch.requests))]
