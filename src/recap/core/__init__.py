"""Proposer-side building blocks: numpy and pure Python only, never torch."""

from recap.core.adjacency import AdjacencyMatrix
from recap.core.cost import CostProfile, ProfileError
from recap.core.static_tree import StaticTreeTemplate
from recap.core.steps import DraftOffer, PromptRows, StepLimits, VerifiedTree
from recap.core.tree import ROOT, DraftTree, TreeBuilder
from recap.core.trie import NGramTrie

__all__ = ["ROOT", "AdjacencyMatrix", "CostProfile", "DraftOffer", "DraftTree", "NGramTrie", "ProfileError",
           "PromptRows", "StaticTreeTemplate", "StepLimits", "TreeBuilder", "VerifiedTree"]
