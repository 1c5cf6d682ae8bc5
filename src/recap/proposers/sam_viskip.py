"""SAM+ViSkip: SAM drafting, skipped while the target is looking at the image.

When the target's attention goes to the image, the next tokens depend on what it sees there,
and text copied from the context is unlikely to be accepted; drafting would only make the
verification forward larger. The gate is the final-layer, head-averaged softmax attention
mass that the latest processed query puts on the prompt's image placeholder tokens
(RECAP paper, appendix A: threshold 0.35, drafts capped at 40 tokens).

The proposer never touches torch: it asks the target for the number by setting
``wants_image_attention``, and `decode` turns the target's capture on
(`TargetModel.capture_image_attention`). Gate semantics: the value that arrived last decides
whether the *next* `propose` drafts. After prefill that is the attention of the last prompt
position (the query that produced the first token, `PromptRows.image_attention`); after each
verification it is that of packed query 0, the tree's root (`VerifiedTree.image_attention`),
i.e. the query that produced the first token of the step's commit. A value >= ``threshold``
gives an empty tree (one autoregressive step) and counts in ``skipped_steps``. No value
(text-only prompt or model, or a target that cannot capture) never gates: plain SAM.
"""

from __future__ import annotations

from collections.abc import Sequence

from recap.core import DraftTree, PromptRows, StepLimits, VerifiedTree
from recap.proposers.sam import SamProposer


class SamViSkipProposer(SamProposer):
    name = "sam-viskip"
    wants_image_attention = True

    def __init__(self, *, threshold: float = 0.35, max_draft: int = 40, **sam_options):
        super().__init__(max_draft=max_draft, **sam_options)
        self.threshold = threshold
        self.skipped_steps = 0
        """Steps the gate turned into empty trees (over this object's life)."""
        self.steps = 0
        """All `propose` calls (over this object's life)."""
        self._attention: float | None = None

    def begin_request(self, prompt: PromptRows) -> None:
        super().begin_request(prompt)
        self._attention = prompt.image_attention

    def observe(self, step: VerifiedTree) -> None:
        self._attention = step.image_attention

    def propose(self, history: Sequence[int], limits: StepLimits | None = None) -> DraftTree:
        self.steps += 1
        if self._attention is not None and self._attention >= self.threshold:
            self.skipped_steps += 1
            return DraftTree.empty()
        return super().propose(history, limits)
