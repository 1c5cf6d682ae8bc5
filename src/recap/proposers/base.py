"""The one interface every drafting method implements.

A proposer sees committed tokens and the target's own predictions (as numpy arrays) and
returns draft trees. It never sees the model, so any proposer runs on any target.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from recap.core import DraftOffer, DraftTree, PromptRows, RowsWanted, StepLimits, VerifiedTree


@runtime_checkable
class Proposer(Protocol):
    """Lifecycle per request: ``begin_request``, then ``propose``/``observe`` per iteration,
    then ``end_request``. One proposer object is one *stream*: state that outlives a request
    (RECAP's U, Token Recycling's matrix) stays on the object until ``reset_stream``;
    request-local state is reset in ``begin_request``.

    Besides the lifecycle, a proposer declares what it asks of the loop (`recap.decoding`),
    which reads these members and never probes for others; `BaseProposer` gives every one a
    default, so a method only sets what it needs."""

    name: str
    stream_state: bool
    """True when state outlives a request (cleared by ``reset_stream``)."""
    wants_cost: bool
    """True: the loop hands ``propose`` the target's verify-cost profile in ``StepLimits.cost``
    (measured once if the target has none yet) and corrects it online with every step's time."""
    wants_image_attention: bool
    """True: the loop turns the target's image-attention capture on for the request, so
    ``PromptRows.image_attention`` and ``VerifiedTree.image_attention`` carry the measurement
    (None where the prompt has no image or the target cannot capture)."""
    rows_wanted: RowsWanted
    """Which prompt rows' Top-K (``PromptRows.topk_ids``, ``topk_logits``) the method reads:
    ``all``; ``first``, each eligible token's first occurrence (token-keyed memories seed from
    those); ``answers``, those of them inside the prompt's earlier assistant turns; ``none``.
    Prefill runs the LM head on those rows and the last one alone."""

    def begin_request(self, prompt: PromptRows) -> None: ...

    def propose(self, history: Sequence[int], limits: StepLimits | None = None) -> DraftTree: ...

    def offer(self, history: Sequence[int], limits: StepLimits | None = None) -> DraftOffer | None:
        """Instead of ``propose``, when a batch shares one verification budget between its
        requests: this step's candidates best first, with their path probabilities, the tree
        then taken by the batch. None: the method sizes its own tree (``propose`` is called)."""

    def observe(self, step: VerifiedTree) -> None: ...

    def end_request(self) -> None: ...

    def fork_request(self) -> Proposer:
        """A proposer for one request that runs while another request of this stream is in
        flight (batched serving): it drafts from the stream as it is now, with request state
        of its own, and the caller runs the request's lifecycle on it."""

    def reset_stream(self) -> None: ...

    def set_reference(self, reference: Sequence[int]) -> None:
        """The output the target is expected to produce (prompt + answer), given by
        `recap.check` before each case; only oracle test drafters use it."""

    def stage_times(self) -> dict[str, dict[str, float]]:
        """Seconds of the named parts of the latest ``propose`` and ``observe`` call, by call
        (``{"propose": {...}, "observe": {...}}``), as the method itself timed them; empty
        for methods that do not time their parts. `recap overhead` reports them."""


class BaseProposer:
    """Defaults for everything `Proposer` declares: no-op lifecycle hooks, nothing asked of
    the loop, so a method only writes what it needs."""

    name = "base"
    stream_state = False
    """True when state outlives a request (cleared by ``reset_stream``): RECAP's U, Token
    Recycling's matrix, Lookahead's output trie. Benchmarks checkpoint such streams."""
    wants_cost = False
    wants_image_attention = False
    rows_wanted: RowsWanted = "all"
    """The safe default: a method that reads the prompt's Top-K rows gets them all; those that
    read fewer say so (RECAP-paper and tree recycling ``first``, RECAP ``answers``; AR, PLD,
    SAM, lookahead and token recycling ``none``), and their prefill skips the head on the rest."""

    def begin_request(self, prompt: PromptRows) -> None:
        self.prompt = prompt

    def propose(self, history: Sequence[int], limits: StepLimits | None = None) -> DraftTree:
        return DraftTree.empty()

    def offer(self, history: Sequence[int], limits: StepLimits | None = None) -> DraftOffer | None:
        return None

    def observe(self, step: VerifiedTree) -> None:
        pass

    def end_request(self) -> None:
        pass

    def fork_request(self) -> Proposer:
        """A copy of the stream as it is now: what the overlapping request learns is not kept
        (`RecapProposer`'s forks share the stream's memory, with request state of their own)."""
        return copy.deepcopy(self)

    def reset_stream(self) -> None:
        """Forget state carried across requests (a new stream starts)."""

    def set_reference(self, reference: Sequence[int]) -> None:
        """Ignored: only drafters that exist to test verification read the expected output."""

    def stage_times(self) -> dict[str, dict[str, float]]:
        return {}


class AutoregressiveProposer(BaseProposer):
    """Plain greedy decoding: an empty tree, so each iteration verifies the root alone.
    It runs through exactly the same loop as every drafter, which keeps timings fair."""

    name = "ar"
    rows_wanted: RowsWanted = "none"
