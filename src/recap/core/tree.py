"""The draft tree: what a proposer hands to the target for one verification.

Pure numpy, no torch. Nodes are stored as flat arrays so the target can pack them into one
forward pass without walking Python objects. The root (the last committed token, whose KV
entry is not cached yet) is implicit: it is packed at position 0, node ``i`` at ``i + 1``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

ROOT = -1
"""Parent index meaning "child of the root"."""


class DraftTree:
    """Draft tokens after the root, with parents before children.

    ``tokens[i]`` is node i's token, ``parents[i]`` its parent (``ROOT`` or an earlier node),
    ``depths[i]`` its distance from the root (1 for the root's children).
    """

    __slots__ = ("tokens", "parents", "depths", "_children")

    def __init__(self, tokens: Sequence[int] | np.ndarray, parents: Sequence[int] | np.ndarray):
        self.tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        self.parents = np.asarray(parents, dtype=np.int64).reshape(-1)
        n = len(self.tokens)
        if len(self.parents) != n:
            raise ValueError(f"{n} tokens but {len(self.parents)} parents")
        if n and (np.any(self.parents < ROOT) or np.any(self.parents >= np.arange(n))):
            raise ValueError("every parent must be ROOT (-1) or an earlier node")
        depths = np.ones(n, dtype=np.int64)
        for i, parent in enumerate(self.parents.tolist()):
            if parent != ROOT:
                depths[i] = depths[parent] + 1
        self.depths = depths
        self._children: list[dict[int, int]] | None = None

    @classmethod
    def _trusted(cls, tokens: list[int], parents: list[int], depths: list[int]) -> DraftTree:
        """Skip validation and depth recomputation for arrays a `TreeBuilder` made."""
        tree = cls.__new__(cls)
        tree.tokens = np.array(tokens, dtype=np.int64)
        tree.parents = np.array(parents, dtype=np.int64)
        tree.depths = np.array(depths, dtype=np.int64)
        tree._children = None
        return tree

    @classmethod
    def empty(cls) -> DraftTree:
        """No draft at all: verification degenerates to one autoregressive step."""
        return cls(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))

    @classmethod
    def from_paths(cls, paths: Iterable[Sequence[int]]) -> DraftTree:
        """Merge token paths from the root into a trie (shared prefixes become shared nodes)."""
        builder = TreeBuilder()
        for path in paths:
            builder.add_path(ROOT, path)
        return builder.build()

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"DraftTree(n={len(self)}, depth={self.max_depth})"

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if len(self) else 0

    def children(self) -> list[dict[int, int]]:
        """For each packed position (root = 0), a map token -> child node index."""
        if self._children is None:
            children: list[dict[int, int]] = [{} for _ in range(len(self) + 1)]
            for i, (token, parent) in enumerate(zip(self.tokens.tolist(), self.parents.tolist())):
                children[parent + 1].setdefault(token, i)
            self._children = children
        return self._children

    def ancestor_matrix(self) -> np.ndarray:
        """Boolean (n+1, n+1) matrix over packed positions: [a, b] is True when b is a or an
        ancestor of a. Row a is exactly what packed position a may attend to in the tree."""
        n = len(self)
        # Each row as a Python int bitmask (a node's = its parent's | its own bit), then all
        # rows unpacked at once: a few microseconds for a 68-node tree, no per-row numpy calls.
        masks = [1]
        for i, parent in enumerate(self.parents.tolist()):
            masks.append(masks[parent + 1] | (1 << (i + 1)))
        width = n // 8 + 1
        packed = np.frombuffer(b"".join(m.to_bytes(width, "little") for m in masks), dtype=np.uint8)
        bits = np.unpackbits(packed.reshape(n + 1, width), axis=1, bitorder="little")
        return np.ascontiguousarray(bits[:, : n + 1]).view(bool)

    def ancestor_lists(self) -> tuple[np.ndarray, np.ndarray]:
        """Each packed position's path, root first and itself last, as CSR arrays:
        ``paths[starts[a]:starts[a + 1]]`` for packed position a (the root's path is [0]).
        What the project's own tree attention reads instead of a mask (`recap.verifier.kernels`)."""
        parents = self.parents.tolist()
        lengths = [1] + [int(d) + 1 for d in self.depths.tolist()]
        starts = np.zeros(len(parents) + 2, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        paths = np.empty(int(starts[-1]), dtype=np.int64)
        paths[0] = 0
        for i, parent in enumerate(parents):
            begin, end = int(starts[i + 1]), int(starts[i + 2])
            parent_begin = int(starts[parent + 1])
            paths[begin:end - 1] = paths[parent_begin:parent_begin + end - 1 - begin]
            paths[end - 1] = i + 1
        return starts, paths

    def packed(self, root: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and depths in packed order: the root at 0 (depth 0), node i at i + 1."""
        n = len(self) + 1
        tokens = np.empty(n, dtype=np.int64)
        tokens[0] = root
        tokens[1:] = self.tokens
        depths = np.zeros(n, dtype=np.int64)
        depths[1:] = self.depths
        return tokens, depths

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from the root's first child down to ``node`` (inclusive)."""
        tokens = []
        while node != ROOT:
            tokens.append(int(self.tokens[node]))
            node = int(self.parents[node])
        return tokens[::-1]


class TreeBuilder:
    """Grows a tree node by node; adding an existing (parent, token) child reuses it."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self._index: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int:
        """Index of the child ``token`` under ``parent``, created if missing."""
        key = (parent, token)
        node = self._index.get(key)
        if node is None:
            node = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.depths.append(1 if parent == ROOT else self.depths[parent] + 1)
            self._index[key] = node
        return node

    def add_path(self, parent: int, tokens: Sequence[int]) -> list[int]:
        """Add a chain under ``parent``, sharing any prefix that already exists."""
        nodes = []
        for token in tokens:
            parent = self.add(parent, token)
            nodes.append(parent)
        return nodes

    def build(self) -> DraftTree:
        return DraftTree._trusted(self.tokens, self.parents, self.depths)


def additive_mask(allowed: np.ndarray, past_len: int, blocked: float) -> np.ndarray:
    """(N, past_len + N) float32 mask: 0 where a packed position may attend (the whole cached
    prefix, and its ancestors-or-self from ``allowed``), ``blocked`` elsewhere."""
    n = allowed.shape[0]
    mask = np.zeros((n, past_len + n), dtype=np.float32)
    mask[:, past_len:] = np.where(allowed, np.float32(0.0), np.float32(blocked))
    return mask
