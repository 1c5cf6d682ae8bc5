"""Token-indexed adjacency matrices: row t holds the target's Top-K tokens after token t.

This is Token Recycling's store (Luo et al., ACL 2025): one dense |V| x K table keyed by the
last token alone, each row replaced by the newest prediction. It is dense because lookup is a
single gather for a whole tree layer and the table is small (|V| x 8 int32: 1.5 MiB at
|V| = 49152, 4.6 MiB at 152064).

Two variants share the code: a persistent table whose empty rows are token 0 (Token
Recycling's zero initialisation, drafted as such), and a request-local table whose empty rows
are ``UNKNOWN`` and whose reset only touches the rows written since the last one.
"""

from __future__ import annotations

import os

import numpy as np

from recap.core.persistence import temporary_path
from recap.errors import InputError

FORMAT = "recap-adjacency-matrix"
UNKNOWN = -1
"""Entry of a row that was never written, in tables created with ``fill=UNKNOWN``."""


class AdjacencyMatrix:
    """A dense (vocab_size, k) int32 table of next-token rows, highest first.

    ``fill`` is what an unwritten row holds: 0 for Token Recycling (a zero-initialised matrix
    drafts token 0), ``UNKNOWN`` when empty rows must yield no children. With
    ``track_writes`` the rows written are remembered so `reset` costs O(rows written)
    instead of O(|V|): what a per-request reset needs.
    """

    __slots__ = ("table", "k", "fill", "_written")

    def __init__(self, vocab_size: int, k: int, *, fill: int = 0, track_writes: bool = False):
        if vocab_size < 1 or k < 1:
            raise ValueError(f"vocab_size and k must be at least 1, got {vocab_size} and {k}")
        self.k = k
        self.fill = fill
        self.table = np.full((vocab_size, k), fill, dtype=np.int32)
        self._written: list[np.ndarray] | None = [] if track_writes else None

    @property
    def vocab_size(self) -> int:
        return self.table.shape[0]

    def write(self, tokens: np.ndarray, rows: np.ndarray, *, first_wins: bool = False) -> None:
        """Store ``rows[i][:k]`` under ``tokens[i]``. When a token occurs more than once in one
        call, the last occurrence wins (a sequential scatter) or, with ``first_wins``, the
        first. The winner is chosen explicitly rather than left to how fancy assignment treats
        repeated indices (the official Token Recycling's ``adj[ids] = topk`` on CUDA gives no
        order guarantee)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if not len(tokens):
            return
        rows = np.asarray(rows)[:, : self.k]
        if rows.shape != (len(tokens), self.k):
            raise ValueError(f"need {len(tokens)} rows of at least {self.k} tokens, got shape {np.shape(rows)}")
        if len(tokens) > 1:
            if first_wins:
                tokens, index = np.unique(tokens, return_index=True)
            else:
                tokens, index = np.unique(tokens[::-1], return_index=True)
                index = len(rows) - 1 - index
            rows = rows[index]
        self.table[tokens] = rows
        if self._written is not None:
            self._written.append(tokens)

    def next_tokens(self, parents: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """``table[parents[i], ranks[i]]`` for all i at once: the children of a tree layer."""
        return self.table[parents, ranks]

    def known(self, tokens: np.ndarray) -> np.ndarray:
        """Which tokens have a written row (only meaningful with ``fill=UNKNOWN``)."""
        return self.table[np.asarray(tokens, dtype=np.int64), 0] != UNKNOWN

    def reset(self) -> None:
        """Every row back to ``fill``: only the written rows when writes are tracked."""
        if self._written is None:
            self.table.fill(self.fill)
            return
        if self._written:
            self.table[np.concatenate(self._written)] = self.fill
            self._written.clear()

    def rows_written(self) -> int:
        """Rows that differ from an unwritten row."""
        return int(np.count_nonzero((self.table != self.fill).any(axis=1)))

    def save(self, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
        """The rows that differ from an unwritten row, with their tokens (safetensors, written
        through a temporary file so an interrupted save leaves no half file); ``metadata``:
        extra string fields stored with the file's own."""
        from safetensors.numpy import save_file

        tokens = np.flatnonzero((self.table != self.fill).any(axis=1)).astype(np.int64)
        own = {"format": FORMAT, "vocab_size": str(self.vocab_size), "k": str(self.k), "fill": str(self.fill)}
        metadata = {**{str(k): str(v) for k, v in (metadata or {}).items()}, **own}
        temporary = temporary_path(path)
        try:
            save_file({"tokens": tokens, "rows": np.ascontiguousarray(self.table[tokens])}, temporary,
                      metadata=metadata)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)

    @classmethod
    def load(cls, path: str | os.PathLike, *, fill: int) -> AdjacencyMatrix:
        """A table saved by `save`; another format or a different ``fill`` is an `InputError`."""
        from safetensors import safe_open

        try:
            with safe_open(os.fspath(path), framework="numpy") as handle:
                metadata = handle.metadata() or {}
                tokens, rows = handle.get_tensor("tokens"), handle.get_tensor("rows")
        except Exception as error:  # safetensors raises several types for damaged files
            raise InputError(f"cannot read adjacency matrix {os.fspath(path)!r}: {error}") from None
        if metadata.get("format") != FORMAT or metadata.get("fill") != str(fill):
            raise InputError(f"{os.fspath(path)!r} is not a {FORMAT} file with fill {fill}")
        matrix = cls(int(metadata["vocab_size"]), int(metadata["k"]), fill=fill)
        matrix.table[tokens] = rows
        return matrix
