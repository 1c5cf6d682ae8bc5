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

from recap.core.persistence import (
    MAX_FILE_BYTES,
    MemoryFileError,
    MemorySnapshot,
    parse_count,
    safetensors_metadata,
)

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
        0600 through a temporary file, fsynced, then renamed: an interrupted save leaves no
        half file); ``metadata``: extra string fields stored with the file's own."""
        self.snapshot().write(path, metadata)

    def snapshot(self) -> MemorySnapshot:
        """A copy of what `save` writes (the written rows and their tokens), to be written
        later, on another thread, while this table goes on changing."""
        tokens = np.flatnonzero((self.table != self.fill).any(axis=1)).astype(np.int64)
        own = {"format": FORMAT, "vocab_size": str(self.vocab_size), "k": str(self.k), "fill": str(self.fill)}
        return MemorySnapshot({"tokens": tokens, "rows": self.table[tokens]}, own)  # a gather: a copy

    @classmethod
    def load(cls, path: str | os.PathLike, *, fill: int, vocab_size: int | None = None,
             max_bytes: int = MAX_FILE_BYTES) -> AdjacencyMatrix:
        """A table saved by `save`, checked whole before anything is built: its format and
        ``fill``, the vocabulary (``vocab_size`` where the caller knows it), exact dtypes and
        shapes, unique tokens and every id inside the vocabulary; a file past ``max_bytes`` is
        not read. Anything else is `MemoryFileError`; an `OSError` while reading propagates."""
        from safetensors import SafetensorError
        from safetensors.numpy import load

        name = os.fspath(path)
        if not os.path.isfile(name):
            raise MemoryFileError(f"adjacency matrix not found: {name}")
        if os.stat(name).st_size > max_bytes:
            raise MemoryFileError(f"adjacency matrix {name} is larger than {max_bytes} bytes")
        with open(name, "rb") as handle:
            data = handle.read(max_bytes + 1)
        try:
            metadata = safetensors_metadata(data)
            tensors = load(data)
            tokens, rows = tensors["tokens"], tensors["rows"]
            size, k = parse_count(metadata["vocab_size"]), parse_count(metadata["k"])
        except (SafetensorError, ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
            raise MemoryFileError(f"cannot read adjacency matrix {name}: {error}") from None
        if metadata.get("format") != FORMAT or metadata.get("fill") != str(fill):
            raise MemoryFileError(f"{name} is not a {FORMAT} file with fill {fill}")
        if vocab_size is not None and size != vocab_size:
            raise MemoryFileError(f"adjacency matrix {name} was made for a vocabulary of {size} tokens, not "
                                  f"{vocab_size}")
        if (not 0 < size <= 1 << 31 or not 0 < k <= 1024 or tokens.dtype != np.int64 or rows.dtype != np.int32
                or tokens.ndim != 1 or rows.shape != (len(tokens), k) or len(tokens) > size
                or len(np.unique(tokens)) != len(tokens)
                or (tokens.size and (tokens.min() < 0 or tokens.max() >= size or rows.min() < min(0, fill)
                                     or rows.max() >= size))):
            raise MemoryFileError(f"adjacency matrix {name} holds inconsistent rows")
        matrix = cls(size, k, fill=fill)
        matrix.table[tokens] = rows
        return matrix
