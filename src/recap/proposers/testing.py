"""Adversarial drafters that exist to test the engine, not to be fast.

`DecoyDrafter` knows the true continuation (from a reference run) and hides it among random
siblings at random depths, so a verifier that accepts the wrong child, lets siblings see
each other or mis-positions deep nodes produces different tokens. `RandomDrafter` drafts
random trees, mostly rejected, to exercise rejection and cache compaction.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from recap.core import ROOT, DraftTree, PromptRows, StepLimits, TreeBuilder
from recap.proposers.base import BaseProposer


class _RandomTreeMixin:
    max_nodes: int
    max_depth: int
    rng: np.random.Generator

    def _random_token(self, history: Sequence[int]) -> int:
        # Half from the history (plausible continuations), half uniform over the vocabulary.
        if history and self.rng.random() < 0.5:
            return int(history[self.rng.integers(len(history))])
        token = int(self.rng.integers(self.prompt.vocab_size))
        return token if token not in self.prompt.excluded_tokens else 0

    def _grow_random(self, builder: TreeBuilder, history: Sequence[int], budget: int) -> None:
        """Attach random nodes under random existing nodes until ``budget`` nodes exist."""
        attempts = 0
        while len(builder) < budget and attempts < 4 * budget:
            attempts += 1
            parent = ROOT if not len(builder) else int(self.rng.integers(-1, len(builder)))
            if parent != ROOT and builder.depths[parent] >= self.max_depth:
                continue
            builder.add(parent, self._random_token(history))


class DecoyDrafter(_RandomTreeMixin, BaseProposer):
    """Puts the true continuation (when known) at a random depth among random decoys.

    ``reference`` is the full token sequence (prompt + reference output) the target is
    expected to produce; ``propose`` finds the continuation of the current history in it.
    Decoys are inserted *before* the true child, so the accepted path is rarely the first
    branch, and the true token also appears under wrong parents.
    """

    name = "decoy"

    def __init__(self, reference: Sequence[int] | None = None, *, seed: int = 0, max_nodes: int = 68,
                 max_depth: int = 10):
        self.reference = list(reference) if reference is not None else None
        self.rng = np.random.default_rng(seed)
        self.max_nodes = max_nodes - 1  # the root counts towards the packed node cap
        self.max_depth = max_depth

    def set_reference(self, reference: Sequence[int]) -> None:
        self.reference = list(reference)

    def _truth(self, history: Sequence[int]) -> list[int]:
        ref = self.reference
        if ref is None or len(ref) <= len(history) or ref[: len(history)] != list(history):
            return []
        # The root is the last history token; the draft continues right after it.
        return ref[len(history) : len(history) + self.max_depth]

    def propose(self, history: Sequence[int], limits: StepLimits | None = None) -> DraftTree:
        budget = int(self.rng.integers(1, self.max_nodes + 1))
        truth = self._truth(history)
        depth = int(self.rng.integers(0, len(truth) + 1)) if truth else 0
        builder = TreeBuilder()
        parent = ROOT
        for token in truth[:depth]:
            if len(builder) >= budget:
                break
            for _ in range(int(self.rng.integers(0, 4))):  # decoy siblings first
                decoy = self._random_token(truth)
                if decoy != token and len(builder) < budget - 1:
                    builder.add(parent, decoy)
            parent = builder.add(parent, token)
        if depth < len(truth) and len(builder) < budget:
            # The next true token placed under a wrong parent: must not be accepted there.
            wrong_parent = int(self.rng.integers(-1, len(builder)))
            if wrong_parent != parent and (wrong_parent == ROOT or builder.depths[wrong_parent] < self.max_depth):
                builder.add(wrong_parent, truth[depth])
        self._grow_random(builder, list(history[-64:]) + truth, budget)
        return builder.build()


class RandomDrafter(_RandomTreeMixin, BaseProposer):
    """Random trees of random size and depth; tokens half from the recent history."""

    name = "random"

    def __init__(self, *, seed: int = 0, max_nodes: int = 68, max_depth: int = 10):
        self.rng = np.random.default_rng(seed)
        self.max_nodes = max_nodes - 1
        self.max_depth = max_depth

    def begin_request(self, prompt: PromptRows) -> None:
        self.prompt = prompt

    def propose(self, history: Sequence[int], limits: StepLimits | None = None) -> DraftTree:
        builder = TreeBuilder()
        self._grow_random(builder, list(history[-64:]), int(self.rng.integers(0, self.max_nodes + 1)))
        return builder.build()
