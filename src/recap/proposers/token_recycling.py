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

The template is read at runtime from ``template=``, else ``$RECAP_TR_TEMPLATE``, else
``../shared/data/token_recycling_tree_2.2.2.json`` beside the repository. It is never copied
into the package.
"""

from __future__ import annotations

import os
from os import PathLike
from pathlib import Path

from recap.core.adjacency import AdjacencyMatrix
from recap.core.static_tree import StaticTreeTemplate
from recap.errors import InputError
from recap.proposers.recycling import RecyclingProposer

TEMPLATE_ENV = "RECAP_TR_TEMPLATE"
TEMPLATE_FILE = "token_recycling_tree_2.2.2.json"
DEFAULT_TEMPLATE = Path(__file__).resolve().parents[3].parent / "shared" / "data" / TEMPLATE_FILE
"""``../shared/data`` next to the repository root (src/recap/proposers/ is three levels down)."""


def template_path(template: str | PathLike | None = None) -> Path:
    """Where the template is read from: the argument, else the env var, else the default."""
    if template is not None:
        return Path(template)
    from_env = os.environ.get(TEMPLATE_ENV)
    return Path(from_env) if from_env else DEFAULT_TEMPLATE


def load_template(template: str | PathLike | None = None) -> StaticTreeTemplate:
    """The "2.2.2" template; a missing file is an `InputError` that says what was tried."""
    path = template_path(template)
    if not path.is_file():
        source = "template=" if template is not None else (f"${TEMPLATE_ENV}" if os.environ.get(TEMPLATE_ENV)
                                                            else "the default location")
        raise InputError(f"Token Recycling's tree template was not found at {str(path)!r} (from {source}); "
                         f"pass template=PATH or set {TEMPLATE_ENV} to the {TEMPLATE_FILE} file "
                         "(it lives in ../shared/data beside the repository and is not shipped)")
    return StaticTreeTemplate.from_json(path)


class TokenRecyclingProposer(RecyclingProposer):
    """Token Recycling: persistent zero-initialised Top-8 matrix, static "2.2.2" tree."""

    name = "token-recycling"
    first_wins = False

    def __init__(self, *, template: str | PathLike | StaticTreeTemplate | None = None, top_k: int = 8):
        super().__init__(template if isinstance(template, StaticTreeTemplate) else load_template(template), top_k)

    def new_matrix(self, vocab_size: int) -> AdjacencyMatrix:
        return AdjacencyMatrix(vocab_size, self.top_k)  # zeros: an unwritten row drafts token 0

    # begin_request (inherited) writes nothing: prefill rows never enter Token Recycling's matrix.

    stream_state = True

    def save_memory(self, path: str | PathLike) -> None:
        """The matrix's written rows, as a safetensors file (what `recap bench` checkpoints)."""
        if self.matrix is None:
            raise InputError("nothing to save: the stream has not seen a request yet")
        self.matrix.save(path)

    def load_memory(self, path: str | PathLike) -> None:
        """Continue the stream saved by `save_memory` (the vocabulary must match the target's)."""
        self.matrix = AdjacencyMatrix.load(path, fill=0)
