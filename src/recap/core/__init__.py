"""Proposer-side building blocks: numpy and pure Python only, never torch."""

from recap.core.steps import PromptRows, VerifiedTree
from recap.core.tree import ROOT, DraftTree, TreeBuilder

__all__ = ["ROOT", "DraftTree", "PromptRows", "TreeBuilder", "VerifiedTree"]
