"""Incremental suffix automaton over prompt + committed tokens.

After each `extend`, the state linked from the last one is the longest suffix of the text that
also ends somewhere earlier; its first end position tells where that earlier occurrence is,
and the tokens after it are the continuation to draft. Amortised O(1) per token.

`occurrences` counts how often each state's strings occur, recomputed in one pass over the
states when the text has grown, so that `frequent_path` can follow, from a match, what most
often came next rather than what came next the first time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from numba import njit


@njit("void(int64[::1], int64[::1], int64[::1])", cache=True)  # compiled at import: never inside a timed step
def _sum_up_links(order: np.ndarray, link: np.ndarray, counts: np.ndarray) -> None:
    """Add every state's count to its suffix link's, longest states first: a state's strings
    occur wherever a longer string linked to it ends."""
    for state in order:
        parent = link[state]
        if parent >= 0:
            counts[parent] += counts[state]


class SuffixAutomaton:
    __slots__ = ("tokens", "_next", "_link", "_length", "_first_end", "_last", "_occurrences")

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        self._next: list[dict[int, int]] = [{}]
        self._link: list[int] = [-1]
        self._length: list[int] = [0]
        self._first_end: list[int] = [-1]
        self._last = 0
        self._occurrences: tuple[int, np.ndarray] | None = None
        """(text length when computed, counts): `occurrences`' cache."""
        for token in tokens:
            self.extend(token)

    def __len__(self) -> int:
        return len(self.tokens)

    def _new_state(self, length: int, first_end: int, transitions: dict[int, int], link: int) -> int:
        self._next.append(transitions)
        self._link.append(link)
        self._length.append(length)
        self._first_end.append(first_end)
        return len(self._length) - 1

    def extend(self, token: int) -> None:
        position = len(self.tokens)
        self.tokens.append(token)
        nxt, link, length = self._next, self._link, self._length
        current = self._new_state(length[self._last] + 1, position, {}, -1)
        state = self._last
        while state != -1 and token not in nxt[state]:
            nxt[state][token] = current
            state = link[state]
        if state == -1:
            link[current] = 0
        else:
            target = nxt[state][token]
            if length[state] + 1 == length[target]:
                link[current] = target
            else:
                clone = self._new_state(length[state] + 1, self._first_end[target], dict(nxt[target]), link[target])
                while state != -1 and nxt[state].get(token) == target:
                    nxt[state][token] = clone
                    state = link[state]
                link[target] = clone
                link[current] = clone
        self._last = current

    def sync(self, text: Sequence[int]) -> None:
        """Extend with the tokens of ``text`` (which starts with this automaton's text) that
        it has not seen yet: what a drafter calls each step with the history."""
        for token in text[len(self.tokens) :]:
            self.extend(int(token))

    def longest_match(self) -> tuple[int, int]:
        """(length, end) of the longest suffix that also ends earlier, at its first earlier end
        position; (0, -1) when nothing matches."""
        state = self._link[self._last] if self.tokens else -1
        if state <= 0:
            return 0, -1
        return self._length[state], self._first_end[state]

    def follow(self, state: int, length: int, token: int) -> tuple[int, int]:
        """Matching *another* text against this one: from (state, length) = the longest
        suffix of that text seen here, read ``token``; returns the new (state, length)."""
        nxt, link = self._next, self._link
        while state > 0 and token not in nxt[state]:
            state = link[state]
            length = self._length[state]
        target = nxt[state].get(token)
        if target is None:
            return 0, 0
        return target, length + 1

    def after(self, state: int, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens that follow the first occurrence of ``state``'s strings."""
        end = self._first_end[state]
        return self.tokens[end + 1 : end + 1 + max_tokens] if state > 0 else []

    def occurrences(self) -> np.ndarray:
        """Per state: how many times its strings occur in the text (0 for the root). O(states)
        when the text grew since the last call, else cached."""
        cached = self._occurrences
        if cached is not None and cached[0] == len(self.tokens):
            return cached[1]
        length = np.asarray(self._length, dtype=np.int64)
        own = np.asarray(self._first_end, dtype=np.int64) == length - 1  # a prefix's state (never a clone)
        own[0] = False
        counts = own.astype(np.int64)
        _sum_up_links(np.argsort(-length, kind="stable"), np.asarray(self._link, dtype=np.int64), counts)
        self._occurrences = (len(self.tokens), counts)
        return counts

    def frequent_path(self, state: int, max_tokens: int, stop: int | None = None) -> list[int]:
        """Up to ``max_tokens`` tokens after ``state``'s strings, each the one that most often
        followed what is matched so far (ties: the one that occurred first, as `after`); ends
        before ``stop``. Where every continuation occurred once this is `after`'s. Bounded
        whatever the text: the transitions scanned along one path number at most the text's
        length plus the path's, since every branch not taken holds occurrences that the next
        state has lost (a hostile store cannot make a step slow)."""
        if state <= 0 or max_tokens <= 0:
            return []
        counts = self.occurrences()
        nxt, first_end, out = self._next, self._first_end, []
        while len(out) < max_tokens:
            best, best_key = None, (-1, 0)
            for token, target in nxt[state].items():
                key = (int(counts[target]), -first_end[target])
                if key > best_key:
                    best, best_key = token, key
            if best is None or best == stop:
                break
            out.append(best)
            state = nxt[state][best]
        return out

    def continuation(self, max_tokens: int, min_match: int = 1) -> list[int]:
        """Up to ``max_tokens`` tokens that followed the earlier occurrence of the longest
        suffix match (of at least ``min_match`` tokens)."""
        length, end = self.longest_match()
        if length < min_match or max_tokens <= 0:
            return []
        return self.tokens[end + 1 : end + 1 + max_tokens]
