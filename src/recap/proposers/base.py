"""The one interface every drafting method implements.

A proposer sees committed tokens and the target's own predictions (as numpy arrays) and
returns draft trees. It never sees the model, so any proposer runs on any target.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from recap.core import DraftTree, PromptRows, StepLimits, VerifiedTree


@runtime_checkable
class Proposer(Protocol):
    """Lifecycle per request: ``begin_request``, then ``propose``/``observe`` per iteration,
    then ``end_request``. One proposer object is one *stream*: state that outlives a request
    (RECAP's U, Token Recycling's matrix) stays on the object until ``reset_stream``;
    request-local state is reset in ``begin_request``."""

    name: str

    def begin_request(self, prompt: PromptRows) -> None: ...

    def propose(self, history: Sequence[int], limits: StepLimits | None = None) -> DraftTree: ...

    def observe(self, step: VerifiedTree) -> None: ...

    def end_request(self) -> None: ...

    def reset_stream(self) -> None: ...


class BaseProposer:
    """No-op lifecycle hooks, so a method only writes what it needs."""

    name = "base"
    stream_state = False
    """True when state outlives a request (cleared by ``reset_stream``): RECAP's U, Token
    Recycling's matrix, Lookahead's output trie. Benchmarks checkpoint such streams."""

    def begin_request(self, prompt: PromptRows) -> None:
        self.prompt = prompt

    def propose(self, history: Sequence[int], limits: StepLimits | None = None) -> DraftTree:
        return DraftTree.empty()

    def observe(self, step: VerifiedTree) -> None:
        pass

    def end_request(self) -> None:
        pass

    def reset_stream(self) -> None:
        """Forget state carried across requests (a new stream starts)."""


class AutoregressiveProposer(BaseProposer):
    """Plain greedy decoding: an empty tree, so each iteration verifies the root alone.
    It runs through exactly the same loop as every drafter, which keeps timings fair."""

    name = "ar"
