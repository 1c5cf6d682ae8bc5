"""Token Recycling (Luo et al., ACL 2025), as the RECAP paper runs it as a baseline.

- Store: a zero-initialised |V| x 8 adjacency matrix; row t = the target's Top-8 after the
  most recent verified position whose token was t. It persists across the requests of a
  stream (this object) and is cleared only by `reset_stream`.
- Draft: the static "2.2.2" template (80 candidates, depth 6) filled layer by layer from the
  last committed token: a node of rank r under a node of token t gets ``M[t][r]``. All 80
  candidates are kept, duplicates included, as in the official static tree; an unwritten row
  drafts token 0, exactly as the zero-initialised matrix does there.
- Refresh: after each verification every packed position (root and all nodes, accepted or
  not) writes its Top-8 under its own token; among repeated tokens in one verification the
  last packed position wins (a sequential scatter: the official ``adj[ids] = topk`` leaves the
  winner unspecified on GPU). Prefill rows are *not* written.

One deviation, for VLMs: a node whose token is in ``prompt.excluded_tokens`` (image
placeholders, which break the forward when drafted) is dropped with its subtree.

The template is ``template=`` (a JSON file of rank paths, or a `StaticTreeTemplate`), else
the file in ``$RECAP_TR_TEMPLATE``, else the built-in "2.2.2" shape (`TEMPLATE_222`), so an
installed wheel needs no file beside it. The tests check that shape against the reference
file ``../shared/data/token_recycling_tree_2.2.2.json`` when it is there.
"""

from __future__ import annotations

import os
from os import PathLike
from pathlib import Path

from recap.core.adjacency import AdjacencyMatrix
from recap.core.persistence import MemorySnapshot
from recap.core.static_tree import StaticTreeTemplate
from recap.errors import InputError
from recap.proposers.recycling import RecyclingProposer

TEMPLATE_ENV = "RECAP_TR_TEMPLATE"
TEMPLATE_FILE = "token_recycling_tree_2.2.2.json"
REFERENCE_TEMPLATE = Path(__file__).resolve().parents[3].parent / "shared" / "data" / TEMPLATE_FILE
"""The reference file in ``../shared/data`` next to the repository root (tests compare with it)."""

TEMPLATE_222: dict[tuple[int, ...], int] = {
    (): 8,
    (0,): 8, (1,): 4, (2,): 3, (3,): 2, (4,): 1, (5,): 1, (6,): 1, (7,): 1,
    (0, 0): 8, (0, 1): 3, (0, 2): 2, (0, 3): 1, (0, 4): 1, (0, 5): 1, (0, 6): 1, (0, 7): 1,
    (1, 0): 2, (1, 1): 1, (2, 0): 1, (3, 0): 1, (4, 0): 1, (5, 0): 1,
    (0, 0, 0): 5, (0, 0, 1): 2, (0, 0, 2): 1, (0, 0, 3): 1, (0, 0, 4): 1, (0, 1, 0): 1, (0, 2, 0): 1,
    (1, 0, 0): 1, (2, 0, 0): 1, (3, 0, 0): 1,
    (0, 0, 0, 0): 3, (0, 0, 0, 1): 1, (0, 0, 0, 2): 1, (0, 0, 1, 0): 1, (0, 1, 0, 0): 1, (1, 0, 0, 0): 1,
    (0, 0, 0, 0, 0): 2, (0, 0, 0, 1, 0): 1,
}
"""Token Recycling's static "2.2.2" tree: how many children (ranks 0..n-1 of the parent's
Top-8 row) each node has, a node being its path of ranks from the root. 80 candidates, 6
layers."""


def builtin_template() -> StaticTreeTemplate:
    """`TEMPLATE_222` as rank paths, layer by layer, parents in the order listed."""
    paths = [(*parent, rank) for parent, children in TEMPLATE_222.items() for rank in range(children)]
    return StaticTreeTemplate.from_paths(sorted(paths, key=len))


def load_template(template: str | PathLike | None = None) -> StaticTreeTemplate:
    """The template from ``template`` or ``$RECAP_TR_TEMPLATE`` (a missing file is an
    `InputError` that says what was tried), else the built-in "2.2.2" shape."""
    from_env = os.environ.get(TEMPLATE_ENV)
    if template is None and not from_env:
        return builtin_template()
    path = Path(template if template is not None else from_env)
    if not path.is_file():
        source = "template=" if template is not None else f"${TEMPLATE_ENV}"
        raise InputError(f"Token Recycling's tree template was not found at {str(path)!r} (from {source}); "
                         f"pass template=PATH or set {TEMPLATE_ENV} to a JSON file of rank paths, or unset it "
                         "to use the built-in 2.2.2 tree")
    return StaticTreeTemplate.from_json(path)


class TokenRecyclingProposer(RecyclingProposer):
    """Token Recycling: persistent zero-initialised Top-8 matrix, static "2.2.2" tree."""

    name = "token-recycling"
    first_wins = False
    rows_wanted = "none"  # the paper's matrix starts from zeros and learns from verify steps only

    def __init__(self, *, template: str | PathLike | StaticTreeTemplate | None = None, top_k: int = 8):
        super().__init__(template if isinstance(template, StaticTreeTemplate) else load_template(template), top_k)

    def new_matrix(self, vocab_size: int) -> AdjacencyMatrix:
        return AdjacencyMatrix(vocab_size, self.top_k)  # zeros: an unwritten row drafts token 0

    # begin_request (inherited) writes nothing: prefill rows never enter Token Recycling's matrix.

    stream_state = True

    def save_memory(self, path: str | PathLike, metadata: dict[str, str] | None = None) -> None:
        """The matrix's written rows, as a safetensors file (what `recap bench` checkpoints);
        ``metadata``: extra string fields stored with it."""
        self.memory_snapshot().write(path, metadata)

    def memory_snapshot(self) -> MemorySnapshot:
        """A copy of what `save_memory` writes (a server writes it on another thread)."""
        if self.matrix is None:
            raise InputError("nothing to save: the stream has not seen a request yet")
        return self.matrix.snapshot()

    def load_memory(self, path: str | PathLike, vocab_size: int | None = None) -> None:
        """Continue the stream saved by `save_memory` (the vocabulary must match the target's:
        ``vocab_size`` where the caller knows it); a file that fails `AdjacencyMatrix.load`'s
        checks is `MemoryFileError` and changes nothing."""
        self.matrix = AdjacencyMatrix.load(path, fill=0, vocab_size=vocab_size)
