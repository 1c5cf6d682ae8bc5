"""What the target reports to a proposer: numpy only, so proposers never touch torch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recap.core.tree import DraftTree


@dataclass(frozen=True)
class PromptRows:
    """The target's predictions over the prompt, computed once by prefill.

    Row p (``topk_ids[p]``, ``topk_logits[p]``, highest first) is the Top-K after prompt
    token p. ``eligible[p]`` is False for image placeholders and special tokens, whose rows
    must not seed token-keyed memories.
    """

    ids: np.ndarray
    topk_ids: np.ndarray
    topk_logits: np.ndarray
    eligible: np.ndarray
    vocab_size: int
    excluded_tokens: frozenset[int]
    """Tokens a drafter must never propose (image placeholders)."""
    image_attention: float | None = None
    """Final-layer, head-averaged attention mass of the last prompt position on the image
    tokens, when the target was asked to capture it (`TargetModel.capture_image_attention`)
    and the prompt has an image; None otherwise."""


@dataclass(frozen=True)
class VerifiedTree:
    """One verification: the tree, the target's Top-K and argmax at every packed position
    (root = 0, node i = i + 1) and the accepted node indices (root excluded)."""

    tree: DraftTree
    topk_ids: np.ndarray
    topk_logits: np.ndarray
    argmax: np.ndarray
    accepted: list[int]
    image_attention: float | None = None
    """As `PromptRows.image_attention`, for packed query 0 (the root) of this verification."""

    @property
    def committed(self) -> list[int]:
        """Accepted draft tokens plus the bonus token (argmax at the last accepted node)."""
        last = self.accepted[-1] + 1 if self.accepted else 0
        return [int(self.tree.tokens[i]) for i in self.accepted] + [int(self.argmax[last])]
