"""Proposer-side building blocks: numpy and pure Python only, never torch."""

from recap.core.adjacency import AdjacencyMatrix
from recap.core.static_tree import StaticTreeTemplate
from recap.core.steps import PromptRows, VerifiedTree
from recap.core.tree import ROOT, DraftTree, TreeBuilder
from recap.core.trie import NGramTrie

__all__ = ["ROOT", "AdjacencyMatrix", "DraftTree", "NGramTrie", "PromptRows", "StaticTreeTemplate", "TreeBuilder",
           "VerifiedTree"]
