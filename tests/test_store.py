"""The stream's output store (`recap.core.store`) and the suffix automaton's matching of
another text (`SuffixAutomaton.follow` / `after` / `frequent_path`), against brute force."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recap.core.store import SEPARATOR, OutputStore
from recap.core.suffix import SuffixAutomaton

TEXT = st.lists(st.integers(0, 3), max_size=40)


def _occurs(needle: list[int], haystack: list[int]) -> int | None:
    """End index of the first occurrence of ``needle`` in ``haystack``."""
    m = len(needle)
    for end in range(m - 1, len(haystack)):
        if haystack[end - m + 1 : end + 1] == needle:
            return end
    return None


def _longest_suffix_in(text: list[int], haystack: list[int]) -> int:
    for length in range(len(text), 0, -1):
        if _occurs(text[len(text) - length :], haystack) is not None:
            return length
    return 0


def _frequent_path(text: list[int], matched: list[int], k: int) -> list[int]:
    """Brute force of `SuffixAutomaton.frequent_path`: k times, the token t for which matched + t
    occurs most often in ``text`` (ties: the one that occurred first), up to a separator."""
    out, w = [], list(matched)
    while len(out) < k:
        best, best_key = None, (-1, 0)
        for t in set(text):
            ends = [e for e in range(len(w), len(text)) if text[e - len(w) : e + 1] == [*w, t]]
            if ends and (len(ends), -min(ends)) > best_key:
                best, best_key = t, (len(ends), -min(ends))
        if best is None or best == SEPARATOR:
            break
        out.append(best)
        w.append(best)
    return out


def _store_text(outputs: list[list[int]]) -> list[int]:
    text = [SEPARATOR]  # every output is preceded by one
    for output in outputs:
        text += [*output, SEPARATOR]
    return text


# ----------------------------------------------------------------------------- follow / after
@settings(max_examples=150, deadline=None)
@given(indexed=TEXT, other=TEXT, k=st.integers(0, 6))
def test_follow_finds_the_longest_suffix_match_like_brute_force(indexed, other, k):
    automaton = SuffixAutomaton(indexed)
    state, length = 0, 0
    for i, token in enumerate(other):
        state, length = automaton.follow(state, length, token)
        seen = other[: i + 1]
        assert length == _longest_suffix_in(seen, indexed)
        if length:
            end = _occurs(seen[len(seen) - length :], indexed)
            assert automaton.after(state, k) == indexed[end + 1 : end + 1 + k]
        else:
            assert state == 0 and automaton.after(state, k) == []


def test_follow_restarts_after_a_token_never_seen():
    automaton = SuffixAutomaton([1, 2, 3, 1, 2, 4])
    state, length = 0, 0
    for token in (1, 2):
        state, length = automaton.follow(state, length, token)
    assert length == 2 and automaton.after(state, 3) == [3, 1, 2]  # the first occurrence
    state, length = automaton.follow(state, length, 9)
    assert (state, length) == (0, 0)
    state, length = automaton.follow(state, length, 4)
    assert length == 1 and automaton.after(state, 5) == []


# ----------------------------------------------------------------------------- OutputStore
def test_longest_match_and_its_continuation():
    store = OutputStore()
    store.add([1, 2, 3, 4, 5])
    store.add([6, 7, 8])
    assert store.outputs[0] == [1, 2, 3, 4, 5] and len(store) == 10
    match = store.matcher()
    match.sync([9, 9, 2, 3])
    assert match.continuation(10) == (2, [4, 5])  # cut at the end of that output
    assert match.continuation(1) == (2, [4])
    match.sync([9, 9, 2, 3, 4, 5])  # only the new tokens are read
    assert match.fed == 6
    assert match.continuation(10) == (4, [])  # the output ended there: nothing follows
    fresh = store.matcher()
    fresh.sync([42])
    assert fresh.continuation(10) == (0, [])


def test_matches_never_run_across_two_outputs():
    store = OutputStore()
    store.add([1, 2, 3])
    store.add([4, 5, 6])
    match = store.matcher()
    match.sync([1, 2, 3, 4, 5])  # "3 4" never occurred: the outputs are separated
    length, continuation = match.continuation(10)
    assert length == 2 and continuation == [6]
    match = store.matcher()
    match.sync([2, 3])
    assert match.continuation(10) == (2, [])  # not [4, 5, 6] from the next output


def test_an_answer_start_matches_the_start_of_an_earlier_answer():
    """`begin_answer`: after the separator the answer's first token continues where an earlier
    answer began with it, not where it occurred later inside one (the first output included:
    the store's text begins with a separator too). Its negative control, the same history
    without `begin_answer`, matches the later occurrence."""
    store = OutputStore()
    store.add([3, 7, 4])
    store.add([6, 7, 4])
    store.add([7, 1, 2])
    started = store.matcher()
    started.begin_answer(2)  # after a 2-token prompt
    started.sync([9, 9, 7])
    assert started.continuation(3) == (2, [1, 2]) and started.fed == 3
    plain = store.matcher()
    plain.sync([9, 9, 7])
    assert plain.continuation(3) == (1, [4])  # the 7s inside the first two outputs
    first = OutputStore()
    first.add([7, 5])
    match = first.matcher()
    match.begin_answer(0)
    match.sync([7])
    assert match.continuation(3) == (2, [5])
    assert len(store) == 3 * 4 and store.flat() == [3, 7, 4, SEPARATOR, 6, 7, 4, SEPARATOR, 7, 1, 2, SEPARATOR]


def test_a_match_continues_with_what_most_often_followed_it():
    """Three answers start with 5: twice 5 6, once 5 8 (the oldest). The store offers 6 (the
    first occurrence, `after`, the negative control, says 8); after 5 6 the two continuations
    occur once each and the first wins, as with `after`; a longer match narrows to its one
    occurrence."""
    store = OutputStore()
    for output in ([5, 8, 1], [5, 6, 2, 3], [5, 6, 4, 3]):
        store.add(output)
    match = store.matcher()
    match.begin_answer(0)
    match.sync([5])
    assert match.continuation(4) == (2, [6, 2, 3])
    assert store.automaton.after(match.state, 1) == [8]
    match.sync([5, 6, 2])
    assert match.continuation(4) == (4, [3])
    assert store.automaton.occurrences()[match.state] == 1
    store.add([5, 8, 9])
    store.add([5, 8, 9])  # the automaton grew: the counts are recomputed
    again = store.matcher()
    again.begin_answer(0)
    again.sync([5])
    assert again.continuation(3) == (2, [8, 9])


@settings(max_examples=150, deadline=None)
@given(text=TEXT, other=TEXT, k=st.integers(1, 6))
def test_frequent_path_agrees_with_brute_force(text, other, k):
    automaton = SuffixAutomaton(text)
    state, length = 0, 0
    for token in other:
        state, length = automaton.follow(state, length, token)
    path = automaton.frequent_path(state, k, stop=None)
    matched = other[len(other) - length :] if length else []
    if length:
        assert path == _frequent_path(text, matched, k)
        assert automaton.occurrences()[state] == len(
            [e for e in range(length - 1, len(text)) if text[e - length + 1 : e + 1] == matched])
    else:
        assert path == []


def test_empty_outputs_are_ignored_and_clear_forgets():
    store = OutputStore()
    store.add([])
    assert len(store) == 0 and not store.outputs
    store.add([3, 4])
    store.clear()
    assert len(store) == 0 and not store.outputs
    match = store.matcher()
    match.sync([3])
    assert match.continuation(5) == (0, [])


def test_bad_bound_is_refused():
    with pytest.raises(ValueError):
        OutputStore(1)


@settings(max_examples=100, deadline=None)
@given(outputs=st.lists(st.lists(st.integers(0, 4), max_size=30), max_size=15), max_tokens=st.integers(2, 60),
       history=TEXT, k=st.integers(1, 8))
def test_bound_keeps_the_most_recent_outputs_and_matches_agree_with_brute_force(outputs, max_tokens, history, k):
    store = OutputStore(max_tokens)
    added = []
    for output in outputs:
        store.add(output)
        if output:
            added.append(output[-max(1, max_tokens // 2 - 1):])
        assert len(store) <= max_tokens
        kept = list(store.outputs)
        # The most recent outputs, newest last, exactly as added (cut to the store's bound).
        if added:
            assert kept and kept[-1] == added[-1]  # the newest output is never dropped
        assert kept == added[len(added) - len(kept):]
        assert store.automaton.tokens == _store_text(kept)
    text = _store_text(list(store.outputs))
    match = store.matcher()
    match.sync(history)
    length, continuation = match.continuation(k)
    assert length == _longest_suffix_in(history, text)
    if length:
        assert continuation == _frequent_path(text, history[len(history) - length :], k)
        assert SEPARATOR not in continuation
    else:
        assert continuation == []
