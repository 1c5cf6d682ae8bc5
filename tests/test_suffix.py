"""The suffix automaton against a brute-force longest-earlier-suffix search."""

from hypothesis import given, settings
from hypothesis import strategies as st

from recap.core.suffix import SuffixAutomaton


def brute_force(tokens: list[int]) -> tuple[int, int]:
    n = len(tokens)
    for length in range(n - 1, 0, -1):
        suffix = tokens[n - length :]
        for end in range(length - 1, n - 1):  # earliest earlier end position
            if tokens[end - length + 1 : end + 1] == suffix:
                return length, end
    return 0, -1


@settings(max_examples=300)
@given(st.lists(st.integers(0, 3), max_size=60), st.integers(1, 6))
def test_matches_brute_force_at_every_prefix(tokens, max_tokens):
    automaton = SuffixAutomaton()
    for i, token in enumerate(tokens):
        automaton.extend(token)
        prefix = tokens[: i + 1]
        length, end = brute_force(prefix)
        assert automaton.longest_match() == (length, end)
        expected = prefix[end + 1 : end + 1 + max_tokens] if length else []
        assert automaton.continuation(max_tokens) == expected


def test_hand_example():
    automaton = SuffixAutomaton([5, 6, 7, 8, 9, 5, 6])
    assert automaton.longest_match() == (2, 1)
    assert automaton.continuation(4) == [7, 8, 9, 5]
    assert automaton.continuation(4, min_match=3) == []
    assert SuffixAutomaton().continuation(4) == []
