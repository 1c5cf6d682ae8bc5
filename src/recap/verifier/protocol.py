"""What the decoding loop needs from a target: the `Target` protocol and its defaults.

`recap.decoding` drives any object that satisfies `Target`: the Hugging Face adapter
`recap.verifier.TargetModel`, or a stand-in such as `recap.overhead.SyntheticTarget`. Every
ability the loop relies on is declared here, including the optional ones (a context limit,
image-attention capture, a verify-cost profile, sampling), so the loop calls them instead of
probing; `BaseTarget` says "not available" for each, and a target overrides what it has.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from recap.core import CostProfile, DraftTree, PromptRows, RowsWanted, VerifiedTree
from recap.errors import InputError

if TYPE_CHECKING:
    from recap.verifier.sampling import Sampler


@runtime_checkable
class Target(Protocol):
    """One request at a time: ``prefill`` (the prompt's KV state, Top-K rows at every prompt
    position, the first token), then per step ``verify`` a draft tree after the last
    committed token and ``commit`` the accepted nodes, and ``release`` at the end."""

    eos_token_ids: Sequence[int]
    vocab_size: int
    past_len: int
    """Tokens in the KV state (what ``verify``'s root attends to besides itself)."""
    max_context: int | None
    """Positions the model holds (prompt + output); None: no limit."""
    sliding_window: int | None
    """A sliding attention window this target's tree verification does not apply per layer
    (a model that declares one without marking its layers); None: none, or every layer's
    window applied exactly. Verification is exact only while the sequence fits in it, so the
    loop refuses longer runs."""
    can_sample: bool
    """Whether ``prefill`` and ``verify`` take a `Sampler` (exact sampling); False: greedy only."""

    def prompt_length(self, inputs: Any) -> int:
        """Tokens of a prompt as this target's ``prefill`` takes it."""

    def prefill(self, inputs: Any, sampler: Sampler | None = None) -> tuple[PromptRows, int]: ...

    def verify(self, root: int, tree: DraftTree, sampler: Sampler | None = None,
               position: int = 0) -> VerifiedTree: ...

    def commit(self, accepted: Sequence[int]) -> None: ...

    def release(self) -> None:
        """Free the request's state (the KV cache), also after an error."""

    def capture_image_attention(self, enabled: bool = True) -> bool:
        """Measure (or stop measuring) the attention mass on the prompt's image; returns
        whether it is measured (False where the model or the prompt cannot give it)."""

    def keep_prompt_rows(self, rows: RowsWanted = "all") -> RowsWanted:
        """Which prompt rows' Top-K the next ``prefill`` computes (`recap.core.RowsWanted`: all,
        each eligible token's first, none: the last row's logits only, and `PromptRows` carries
        empty arrays); returns what it will compute (at least what was asked)."""

    def verify_cost(self) -> CostProfile | None:
        """What verifying N tokens costs (`CostProfile`), for cost-aware proposers; None:
        unknown, so such a proposer keeps its fixed budget."""

    batches: bool
    """Whether lanes from ``fork`` share one forward per step (`recap.verifier.batch`), so that
    continuous batching pays; False: requests are best decoded one at a time."""

    def fork(self) -> Target | None:
        """Another lane over the same model, with request state of its own, so that several
        requests can be between prefill and release at once; None: one request at a time."""

    def prefill_chunks(self, inputs: Any) -> Any | None:
        """The prompt's prefill as chunks a batch runs inside its steps
        (`recap.verifier.kernels.prefix.ChunkedPrefill`); None: ``prefill`` runs it whole."""

    def encode_images(self, inputs: Any) -> Any:
        """The inputs with any image already through the vision tower (a server calls this
        while preparing a request, off the decoding thread); unchanged where nothing is gained."""


class BaseTarget:
    """Defaults for the optional part of `Target`: no context limit, no sliding window, no
    image-attention capture, no cost profile, greedy only, one request at a time."""

    max_context: int | None = None
    batches = False
    sliding_window: int | None = None
    can_sample = False

    def prompt_length(self, inputs: Any) -> int:
        return len(inputs)

    def release(self) -> None:
        pass

    def capture_image_attention(self, enabled: bool = True) -> bool:
        return False

    def keep_prompt_rows(self, rows: RowsWanted = "all") -> RowsWanted:
        return "all"  # its prefill always gives them

    def verify_cost(self) -> CostProfile | None:
        return None

    def fork(self) -> Target | None:
        return None

    def prefill_chunks(self, inputs: Any) -> Any | None:
        return None

    def encode_images(self, inputs: Any) -> Any:
        return inputs

    def _refuse_sampler(self, sampler: Sampler | None) -> None:
        """For greedy-only targets: a sampler is an error, not silently ignored."""
        if sampler is not None:
            raise InputError(f"{type(self).__name__} decodes greedily only: it cannot sample")
