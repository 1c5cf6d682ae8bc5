"""SAM: suffix-automaton drafting (after SAM-Decoding, Hu et al. 2025, arXiv 2411.10666).

A suffix automaton over prompt + committed tokens (request-local, extended incrementally with
the tokens committed since the last step) finds the longest suffix of the history that also
occurred earlier. The tokens that followed its first earlier occurrence are drafted as one
chain. The longer the match, the more of its continuation is trusted:

    draft length = clamp(floor(alpha * match_length), min_draft, max_draft)   (alpha 4, 2..40)

This is the rule of SAM-Decoding's retrieval-only drafter (hyx1999/SAM-Decoding,
``samd_sam_only/sam/dyn_sam.py``: ``n = min(max_predicts, 1 + int(match_length * alpha))``
tokens including the last committed one, alpha = 4.0), with the cap set to the RECAP paper's
"draft lengths 2-40" (appendix A). Since alpha * 1 >= 2, the lower bound only matters for
alpha < 2. No match shorter than ``min_match`` (default 1) drafts nothing, and a token in
``prompt.excluded_tokens`` (an image placeholder) ends the chain before it.
"""

from __future__ import annotations

from collections.abc import Sequence

from recap.core import DraftTree, PromptRows, StepLimits
from recap.core.suffix import SuffixAutomaton
from recap.proposers.base import BaseProposer


class SamProposer(BaseProposer):
    name = "sam"
    rows_wanted = "none"

    def __init__(self, *, alpha: float = 4.0, min_draft: int = 2, max_draft: int = 40, min_match: int = 1):
        if not 1 <= min_draft <= max_draft:
            raise ValueError(f"need 1 <= min_draft <= max_draft, got {min_draft} and {max_draft}")
        if alpha <= 0 or min_match < 1:
            raise ValueError(f"need alpha > 0 and min_match >= 1, got {alpha} and {min_match}")
        self.alpha = alpha
        self.min_draft = min_draft
        self.max_draft = max_draft
        self.min_match = min_match
        self._automaton = SuffixAutomaton()

    def begin_request(self, prompt: PromptRows) -> None:
        self.prompt = prompt
        self._automaton = SuffixAutomaton()

    def draft_length(self, match_length: int) -> int:
        """How many continuation tokens a match of ``match_length`` tokens earns."""
        return max(self.min_draft, min(self.max_draft, int(self.alpha * match_length)))

    def propose(self, history: Sequence[int], limits: StepLimits | None = None) -> DraftTree:
        automaton = self._automaton
        automaton.sync(history)
        length, end = automaton.longest_match()
        if length < self.min_match:
            return DraftTree.empty()
        draft: list[int] = []
        excluded = self.prompt.excluded_tokens
        for token in automaton.tokens[end + 1 : end + 1 + self.draft_length(length)]:
            if token in excluded:
                break
            draft.append(token)
        return DraftTree(draft, list(range(-1, len(draft) - 1)))
