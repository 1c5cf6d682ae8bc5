"""What the target reports to a proposer: numpy only, so proposers never touch torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from recap.core.cost import CostProfile
from recap.core.tree import DraftTree

RowsWanted = Literal["all", "first", "answers", "none"]
"""Which prompt rows' Top-K a proposer reads (`Proposer.rows_wanted`), so that prefill runs
the LM head on those alone (the last row's logits are always computed): ``all``; ``first``,
the row at each eligible token's first occurrence (`first_eligible`: what token-keyed
memories seed from); ``answers``, those of the ``first`` rows that lie inside the prompt's
earlier assistant turns (`TargetModel.answer_mask`); ``none``."""
ROWS_WANTED: tuple[RowsWanted, ...] = ("none", "answers", "first", "all")
"""Narrowest first: rows computed for a choice serve every choice before it."""
NOT_COMPUTED = -1
"""``PromptRows.topk_ids`` of a row prefill did not compute (its logits are -inf)."""


def first_eligible(ids: np.ndarray, eligible: np.ndarray) -> np.ndarray:
    """Positions (ascending) of each eligible token's first occurrence in the prompt: the
    rows a ``first`` proposer reads and a ``first`` prefill computes."""
    candidates = np.flatnonzero(np.asarray(eligible, dtype=bool).reshape(-1))
    if not len(candidates):
        return candidates
    _, first = np.unique(np.asarray(ids).reshape(-1)[candidates], return_index=True)
    return np.sort(candidates[first])


def rows_at(topk_ids: np.ndarray, topk_logits: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The Top-K rows at ``positions``; a ValueError where prefill did not compute one (a
    proposer reading rows its `RowsWanted` did not ask for), never a silent seed of -1s."""
    ids = np.asarray(topk_ids)[positions]
    if len(ids) and ids.shape[1] and bool((ids[:, 0] == NOT_COMPUTED).any()):
        missing = np.asarray(positions)[ids[:, 0] == NOT_COMPUTED]
        raise ValueError(f"prompt rows {missing[:8].tolist()} were not computed: the proposer reads rows "
                         "its rows_wanted did not ask for")
    return ids, np.asarray(topk_logits)[positions]


@dataclass(frozen=True)
class PromptRows:
    """The target's predictions over the prompt, computed once by prefill.

    Row p (``topk_ids[p]``, ``topk_logits[p]``, highest first) is the Top-K after prompt
    token p. ``eligible[p]`` is False for image placeholders and special tokens, whose rows
    must not seed token-keyed memories. A prefill asked for ``first`` rows only
    (`RowsWanted`) leaves the others ``NOT_COMPUTED`` (id -1, logits -inf); one asked for
    ``none`` gives (0, K) arrays.
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
    """One verification: the tree, the target's Top-K and its choice at every packed position
    (root = 0, node i = i + 1) and the accepted node indices (root excluded). The choice is
    the argmax under greedy decoding; under sampling, the draw at each position the walk
    reached (argmax elsewhere)."""

    tree: DraftTree
    topk_ids: np.ndarray
    topk_logits: np.ndarray
    argmax: np.ndarray
    accepted: list[int]
    image_attention: float | None = None
    """As `PromptRows.image_attention`, for packed query 0 (the root) of this verification."""
    kept: int | None = None
    """How many committed tokens the output kept, when EOS or the token limit cut the step
    short (None: all). What proposers learn from the text stops there."""

    @property
    def committed(self) -> list[int]:
        """Accepted draft tokens plus the bonus token (the choice at the last accepted node),
        cut to ``kept``."""
        last = self.accepted[-1] + 1 if self.accepted else 0
        tokens = [int(self.tree.tokens[i]) for i in self.accepted] + [int(self.argmax[last])]
        return tokens if self.kept is None else tokens[: self.kept]


@dataclass(frozen=True)
class StepLimits:
    """What the caller tells a proposer about the coming verification. Cost-aware proposers
    size their tree with it; the baselines keep their authors' own sizing rules."""

    cost: CostProfile | None = None
    """Predicted verify time by packed size (root included) and context length; None: the
    proposer's fixed budget applies."""
    context_len: int = 0
    """Tokens already in the KV cache before this step's root."""
    max_nodes: int | None = None
    """Hard cap on draft nodes (root excluded), e.g. what the context window still holds."""
    remaining: int | None = None
    """Tokens the request may still commit (this step's bonus token included)."""
    stop_tokens: frozenset[int] = frozenset()
    """Tokens that end the request once committed (EOS): a draft past one is never used, and
    a path that ends in one finishes the request like a path as deep as ``remaining``."""

    @property
    def max_depth(self) -> int | None:
        """The deepest draft the request can still use (``remaining - 1``; None: unknown)."""
        return None if self.remaining is None else self.remaining - 1


@dataclass(frozen=True)
class DraftOffer:
    """A cost-aware proposer's candidates for one step, best first, for a batch that shares
    one verification budget between requests (`recap.core.chooser.share_budget`)."""

    gains: np.ndarray
    """Path probability of the i-th best node (non-increasing; every node after its parent)."""
    take: Callable[[int], DraftTree]
    """The tree of the best n nodes; the proposer learns from it as from its own choice."""
