"""Proposer-side building blocks: numpy and pure Python only, never torch."""

from recap.core.adjacency import AdjacencyMatrix
from recap.core.cost import CostProfile, ProfileError
from recap.core.static_tree import StaticTreeTemplate
from recap.core.steps import (
    NOT_COMPUTED,
    ROWS_WANTED,
    DraftOffer,
    PromptRows,
    RowsWanted,
    StepLimits,
    VerifiedTree,
    first_eligible,
    rows_at,
)
from recap.core.tree import ROOT, DraftTree, TreeBuilder
from recap.core.trie import NGramTrie

__all__ = ["NOT_COMPUTED", "ROOT", "ROWS_WANTED", "AdjacencyMatrix", "CostProfile", "DraftOffer", "DraftTree",
           "NGramTrie", "ProfileError", "PromptRows", "RowsWanted", "StaticTreeTemplate", "StepLimits", "TreeBuilder",
           "VerifiedTree", "first_eligible", "rows_at"]
