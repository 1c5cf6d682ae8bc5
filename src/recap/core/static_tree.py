"""Static draft-tree templates: a fixed shape whose nodes are filled from a table of ranked rows.

Token Recycling and Tree Recycling do not search: every node of the template is "the r-th
entry of my parent's row". The shape never changes, so parents, ranks and the depth layers are
computed once, and filling a tree is one gather per layer (all nodes of a depth at once). Nodes
that cannot be filled (no row for the parent, or a token that must not be drafted) are dropped
with their subtrees and the survivors compacted, still parents before children.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from os import PathLike

import numpy as np

from recap.core.tree import ROOT, DraftTree
from recap.errors import InputError

NextTokens = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""``next_tokens(parent_tokens, ranks)`` -> child tokens (int array); a negative entry means
"no child here" (its node and subtree are dropped)."""


class StaticTreeTemplate:
    """A tree shape: node i is the ``ranks[i]``-th token of the row of ``parents[i]``
    (``ROOT`` = the last committed token). Nodes are ordered by depth, parents first."""

    __slots__ = ("parents", "ranks", "depths", "layers", "max_rank", "_gather")

    def __init__(self, parents: Sequence[int] | np.ndarray, ranks: Sequence[int] | np.ndarray):
        parents = np.asarray(parents, dtype=np.int64).reshape(-1)
        ranks = np.asarray(ranks, dtype=np.int64).reshape(-1)
        n = len(parents)
        if len(ranks) != n or n == 0:
            raise InputError(f"a tree template needs as many ranks as parents (and at least one node); "
                             f"got {len(ranks)} ranks, {n} parents")
        if np.any(parents < ROOT) or np.any(parents >= np.arange(n)):
            raise InputError("every template node's parent must be ROOT (-1) or an earlier node")
        if np.any(ranks < 0):
            raise InputError("template ranks cannot be negative")
        depths = np.ones(n, dtype=np.int64)
        for i, parent in enumerate(parents.tolist()):
            if parent != ROOT:
                depths[i] = depths[parent] + 1
        if np.any(np.diff(depths) < 0):  # reorder by depth (stable), so each layer is one slice
            order = np.argsort(depths, kind="stable")
            new_index = np.empty(n, dtype=np.int64)
            new_index[order] = np.arange(n)
            parents = np.where(parents[order] == ROOT, ROOT, new_index[np.maximum(parents[order], 0)])
            ranks, depths = ranks[order], depths[order]
        bounds = np.flatnonzero(np.diff(depths)) + 1
        starts = [0, *bounds.tolist()]
        ends = [*bounds.tolist(), n]
        self.parents = parents
        self.ranks = ranks
        self.depths = depths
        self.layers = [slice(s, e) for s, e in zip(starts, ends)]
        self.max_rank = int(ranks.max())
        # Per layer: its slice, the packed positions of its parents, and its ranks (contiguous).
        self._gather = [(layer, np.ascontiguousarray(parents[layer] + 1), np.ascontiguousarray(ranks[layer]))
                        for layer in self.layers]

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> StaticTreeTemplate:
        """Each path is the child ranks from the root to one node (``[0, 1]``: the best
        token's second-best successor). Every proper prefix must be listed earlier."""
        index: dict[tuple[int, ...], int] = {}
        parents, ranks = [], []
        for i, path in enumerate(paths):
            key = tuple(int(r) for r in path)
            if not key:
                raise InputError(f"template path {i} is empty")
            if key in index:
                raise InputError(f"template path {list(key)} is listed twice")
            parent = ROOT if len(key) == 1 else index.get(key[:-1])
            if parent is None:
                raise InputError(f"template path {list(key)} comes before its parent {list(key[:-1])}")
            index[key] = i
            parents.append(parent)
            ranks.append(key[-1])
        return cls(parents, ranks)

    @classmethod
    def from_json(cls, path: str | PathLike) -> StaticTreeTemplate:
        """A JSON file with a ``paths`` list (see `from_paths`)."""
        try:
            with open(path) as handle:
                data = json.load(handle)
        except OSError as error:
            raise InputError(f"cannot read the tree template {str(path)!r}: {error.strerror or error}") from None
        except json.JSONDecodeError as error:
            raise InputError(f"the tree template {str(path)!r} is not valid JSON: {error}") from None
        paths = data.get("paths") if isinstance(data, dict) else None
        if not isinstance(paths, list) or not all(
                isinstance(p, list) and all(isinstance(r, int) for r in p) for p in paths):
            raise InputError(f"the tree template {str(path)!r} needs a 'paths' list of lists of integer ranks")
        return cls.from_paths(paths)

    @classmethod
    def full(cls, width: int, depth: int) -> StaticTreeTemplate:
        """The complete tree: every node has children of ranks 0..width-1, down to ``depth``
        (width + width^2 + ... + width^depth nodes)."""
        if width < 1 or depth < 1:
            raise InputError(f"a full tree needs width and depth >= 1, got {width} and {depth}")
        parents, ranks = [], []
        layer = [ROOT]
        for _ in range(depth):
            nxt = []
            for parent in layer:
                for rank in range(width):
                    nxt.append(len(parents))
                    parents.append(parent)
                    ranks.append(rank)
            layer = nxt
        return cls(parents, ranks)

    # ------------------------------------------------------------------ use
    def __len__(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return int(self.depths[-1])

    def paths(self) -> list[list[int]]:
        """Rank paths from the root, one per node (the inverse of `from_paths`)."""
        out: list[list[int]] = []
        for parent, rank in zip(self.parents.tolist(), self.ranks.tolist()):
            out.append([rank] if parent == ROOT else [*out[parent], rank])
        return out

    def expand(self, root_token: int, next_tokens: NextTokens, excluded: np.ndarray | None = None) -> DraftTree:
        """Fill the template layer by layer from ``root_token``.

        ``next_tokens`` gives each node's token from its parent's token and its rank (one
        vectorised call per layer). A node is dropped with its subtree when its token is
        negative (no row) or ``excluded[token]`` is True (a token that must not be drafted;
        the mask must cover every token the rows can hold). Duplicate siblings are kept: the
        template's shape is the method's definition.
        """
        n = len(self.parents)
        packed = np.empty(n + 1, dtype=np.int64)  # packed position p holds node p - 1; 0 = the root
        packed[0] = root_token
        alive: np.ndarray | None = None  # None while every node so far is kept (the common case)
        for layer, source, ranks in self._gather:
            # A dropped parent's token may be -1 (a valid numpy index): its child is dropped anyway.
            tokens = np.asarray(next_tokens(packed[source], ranks), dtype=np.int64)
            packed[layer.start + 1 : layer.stop + 1] = tokens
            ok = tokens >= 0
            if excluded is not None:
                ok &= ~excluded[tokens]
            if alive is not None:
                ok &= alive[source]
            elif ok.all():
                continue
            else:
                alive = np.ones(n + 1, dtype=bool)
            alive[layer.start + 1 : layer.stop + 1] = ok
        if alive is None:
            return DraftTree._trusted(packed[1:], self.parents, self.depths)
        keep = alive[1:]
        new_index = np.cumsum(keep) - 1
        parents = self.parents[keep]
        parents = np.where(parents == ROOT, ROOT, new_index[np.maximum(parents, 0)])
        return DraftTree._trusted(packed[1:][keep], parents, self.depths[keep])
