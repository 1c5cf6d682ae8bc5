"""Drafting methods. Add a new one as a module here and register it in `PROPOSERS`."""

from __future__ import annotations

from collections.abc import Callable

from recap.errors import InputError
from recap.proposers.base import AutoregressiveProposer, BaseProposer, Proposer
from recap.proposers.lookahead import LookaheadProposer
from recap.proposers.pld import PromptLookupProposer
from recap.proposers.recap import ABLATIONS, PAPER, RecapConfig, RecapPaperProposer, RecapProposer
from recap.proposers.sam import SamProposer
from recap.proposers.sam_viskip import SamViSkipProposer
from recap.proposers.testing import DecoyDrafter, RandomDrafter
from recap.proposers.token_recycling import TokenRecyclingProposer
from recap.proposers.tree_recycling import TreeRecyclingProposer

PROPOSERS: dict[str, Callable[..., Proposer]] = {
    "ar": AutoregressiveProposer,
    "recap": RecapProposer,
    "recap-paper": RecapPaperProposer,
    "pld": PromptLookupProposer,
    "lookahead": LookaheadProposer,
    "sam": SamProposer,
    "sam-viskip": SamViSkipProposer,
    "token-recycling": TokenRecyclingProposer,
    "tree-recycling": TreeRecyclingProposer,
    "decoy": DecoyDrafter,
    "random": RandomDrafter,
}
"""Method name -> factory. ``decoy`` and ``random`` are test drafters for the engine."""


def make_proposer(name: str, **options) -> Proposer:
    """Build a proposer by its registered name; unknown names are an `InputError`."""
    try:
        factory = PROPOSERS[name]
    except KeyError:
        raise InputError(f"unknown method {name!r}; choose one of: {', '.join(PROPOSERS)}") from None
    return factory(**options)


__all__ = ["ABLATIONS", "PAPER", "PROPOSERS", "AutoregressiveProposer", "BaseProposer", "DecoyDrafter",
           "LookaheadProposer", "PromptLookupProposer", "Proposer", "RandomDrafter", "RecapConfig",
           "RecapPaperProposer", "RecapProposer", "SamProposer", "SamViSkipProposer", "TokenRecyclingProposer",
           "TreeRecyclingProposer", "make_proposer"]
