"""DraftTree: construction, ancestor matrix and the greedy acceptance walk."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from recap.core import ROOT, DraftTree, TreeBuilder
from recap.verifier import acceptance


def test_from_paths_shares_prefixes_and_sets_depths():
    tree = DraftTree.from_paths([[5, 6, 7], [5, 6, 8], [9]])
    assert tree.tokens.tolist() == [5, 6, 7, 8, 9]
    assert tree.parents.tolist() == [ROOT, 0, 1, 1, ROOT]
    assert tree.depths.tolist() == [1, 2, 3, 3, 1]
    assert tree.path_tokens(3) == [5, 6, 8]


def test_ancestor_matrix_by_hand():
    #        root
    #       /    \
    #     a(0)   d(3)
    #    /   \
    #  b(1)  c(2)
    tree = DraftTree([10, 11, 12, 13], [ROOT, 0, 0, ROOT])
    expected = np.array([
        [1, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0],  # a
        [1, 1, 1, 0, 0],  # b sees root, a, itself
        [1, 1, 0, 1, 0],  # c does not see its sibling b
        [1, 0, 0, 0, 1],  # d
    ], dtype=bool)
    assert np.array_equal(tree.ancestor_matrix(), expected)


def test_accept_follows_the_matching_child_not_the_first():
    tree = DraftTree([10, 11, 12, 13], [ROOT, ROOT, 1, 1])
    # packed: root=0, n0=1, n1=2, n2=3, n3=4. Target wants 11 after root, 13 after 11.
    argmax = np.array([11, 99, 13, 99, 42])
    assert acceptance.greedy(tree, argmax) == [1, 3]
    assert acceptance.greedy(tree, np.array([7, 0, 0, 0, 0])) == []


def test_empty_tree_accepts_nothing():
    tree = DraftTree.empty()
    assert len(tree) == 0 and acceptance.greedy(tree, np.array([3])) == []
    assert tree.ancestor_matrix().shape == (1, 1)


@pytest.mark.parametrize("parents", [[0], [ROOT, 1], [ROOT, -2]])
def test_invalid_parents_are_rejected(parents):
    with pytest.raises(ValueError):
        DraftTree(list(range(len(parents))), parents)


def test_builder_reuses_existing_children():
    builder = TreeBuilder()
    first = builder.add_path(ROOT, [1, 2])
    second = builder.add_path(ROOT, [1, 3])
    assert first[0] == second[0] and len(builder) == 3


@st.composite
def trees_and_argmax(draw):
    n = draw(st.integers(0, 40))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    argmax = draw(st.lists(st.integers(0, 4), min_size=n + 1, max_size=n + 1))
    return DraftTree(tokens, parents), np.array(argmax)


@given(trees_and_argmax())
def test_accept_matches_brute_force(case):
    tree, argmax = case
    # Brute force: the longest root path whose every token equals the argmax after its parent,
    # choosing the first-created child on ties (as TreeBuilder dedupes, ties are equal tokens).
    path, position = [], 0
    while True:
        children = [i for i in range(len(tree))
                    if tree.parents[i] + 1 == position and tree.tokens[i] == argmax[position]]
        if not children:
            break
        path.append(children[0])
        position = children[0] + 1
    assert acceptance.greedy(tree, argmax) == path
    allowed = tree.ancestor_matrix()
    for i in range(len(tree)):
        ancestors = {0, i + 1}
        node = tree.parents[i]
        while node != ROOT:
            ancestors.add(node + 1)
            node = tree.parents[node]
        assert set(np.flatnonzero(allowed[i + 1]).tolist()) == ancestors
