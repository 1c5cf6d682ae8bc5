"""The stream's earlier outputs, as a source of long continuations (after SuffixDecoding's
global tree over earlier outputs).

Requests of one stream often replay what an earlier answer said (captions of similar images,
a fixed answer format). `OutputStore` keeps the stream's last outputs in a suffix automaton,
separated so no match spans two outputs, bounded like U: past ``max_tokens`` it keeps only
the most recent outputs that fill half of it. A `StoreMatch` follows the current request's
history through the store and offers what most often followed the longest match, token by
token (`SuffixAutomaton.frequent_path`): in a stream of hundreds of answers that open with a
few templates, the commonest one, not the oldest answer's (ties go to the oldest, as before).

Every output is preceded by a separator too (the store's text begins with one), and a request's
match reads one where its answer begins (`StoreMatch.begin_answer`): so the first tokens of an
answer match the first tokens of earlier answers, not the same words wherever they occurred
(measured: an answer that repeated the previous one word for word was drafted from the middle
of it, " Luminaria" after "The", instead of from its start).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from recap.core.suffix import SuffixAutomaton

SEPARATOR = -1
"""Written before the first output and after every output: never a token, so no match runs
across two outputs, and an answer's start is a context of its own."""


class OutputStore:
    def __init__(self, max_tokens: int = 16384):
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be at least 2, got {max_tokens}")
        self.max_tokens = max_tokens
        self.outputs: deque[list[int]] = deque()
        self.automaton = SuffixAutomaton([SEPARATOR])

    def __len__(self) -> int:
        """Tokens remembered, separators included (the leading one not counted)."""
        return len(self.automaton) - 1

    def add(self, output: Sequence[int]) -> None:
        """Remember one finished output (only the tokens the user got)."""
        output = [int(t) for t in output]
        if not output:
            return
        output = output[-max(1, self.max_tokens // 2 - 1):]  # (a bound of 2 or 3 still keeps one token)
        self.outputs.append(output)
        if len(self) + len(output) + 1 > self.max_tokens:
            kept, size = [], 0
            for earlier in reversed(self.outputs):
                if kept and size + len(earlier) + 1 > self.max_tokens // 2:  # the newest always stays
                    break
                kept.append(earlier)
                size += len(earlier) + 1
            self.outputs = deque(reversed(kept))
            self.automaton = SuffixAutomaton([SEPARATOR])
            for earlier in self.outputs:
                self._append(earlier)
        else:
            self._append(output)

    def _append(self, output: list[int]) -> None:
        for token in output:
            self.automaton.extend(token)
        self.automaton.extend(SEPARATOR)

    def clear(self) -> None:
        self.outputs.clear()
        self.automaton = SuffixAutomaton([SEPARATOR])

    def flat(self) -> list[int]:
        """The remembered outputs, each followed by `SEPARATOR` (what a memory file stores)."""
        return [token for output in self.outputs for token in (*output, SEPARATOR)]

    def restore(self, flat: Sequence[int]) -> None:
        """Replace the store by the outputs of a `flat` listing (oldest first)."""
        self.clear()
        output: list[int] = []
        for token in flat:
            if int(token) == SEPARATOR:
                self.add(output)
                output = []
            else:
                output.append(int(token))
        self.add(output)

    def matcher(self) -> StoreMatch:
        return StoreMatch(self.automaton)


class StoreMatch:
    """The longest suffix of a growing text (the request's history) that occurs in the store."""

    __slots__ = ("automaton", "state", "length", "fed")

    def __init__(self, automaton: SuffixAutomaton):
        self.automaton = automaton
        self.state = 0
        self.length = 0
        self.fed = 0

    def sync(self, history: Sequence[int]) -> None:
        """Read the tokens of ``history`` not read yet."""
        follow = self.automaton.follow
        state, length = self.state, self.length
        for token in history[self.fed :]:
            state, length = follow(state, length, int(token))
        self.state, self.length, self.fed = state, length, len(history)

    def begin_answer(self, fed: int) -> None:
        """The answer starts after the history's first ``fed`` tokens (the prompt, which the
        store does not hold, so it is not read): the match becomes the separator that precedes
        every stored output."""
        self.state, self.length = self.automaton.follow(0, 0, SEPARATOR)
        self.fed = fed

    def continuation(self, max_tokens: int) -> tuple[int, list[int]]:
        """(match length, up to ``max_tokens`` tokens that followed the match in the store,
        each the most frequent next token (`SuffixAutomaton.frequent_path`), cut at an
        output's end)."""
        if self.length == 0:
            return 0, []
        return self.length, self.automaton.frequent_path(self.state, max_tokens, stop=SEPARATOR)
