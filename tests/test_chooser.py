"""The per-step tree-size chooser (`recap.core.chooser`): candidates, path probabilities, the
value-maximising prefix and the tree it yields. Pure numpy; no wall-clock assertions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recap.core import ROOT, CostProfile, DraftTree
from recap.core.chooser import Candidates, best_size, choose


def _chain_candidates(n: int, prob: float) -> Candidates:
    """n candidates, each the only child of the previous one."""
    return Candidates(list(range(100, 100 + n)), [ROOT] + list(range(n - 1)), list(range(1, n + 1)), [prob] * n,
                      list(range(n)))


def _bushy_candidates(n: int, prob: float) -> Candidates:
    """n candidates under the root and its first child (8 wide at most per parent)."""
    tokens, parents, depths = [], [], []
    for i in range(n):
        parent = ROOT if i < 8 else (i - 8) // 8
        tokens.append(i)
        parents.append(parent)
        depths.append(1 if parent == ROOT else depths[parent] + 1)
    return Candidates(tokens, parents, depths, [prob] * n, list(range(n)))


def _list(values) -> list:
    """Lists or arrays (of numbers or of lists) as plain nested lists."""
    return [_list(v) if isinstance(v, (list, tuple, np.ndarray)) else v.item() if isinstance(v, np.generic) else v
            for v in values]


def _paths(tree: DraftTree) -> list[tuple[int, ...]]:
    return [tuple(tree.path_tokens(i)) for i in range(len(tree))]


def _candidate_paths(candidates: Candidates) -> dict[tuple[int, ...], int]:
    """Token path from the root -> candidate index (paths are unique: siblings differ)."""
    out = {}
    tokens, parents = _list(candidates.tokens), _list(candidates.parents)
    for i in range(len(candidates)):
        path, node = [], i
        while node != ROOT:
            path.append(tokens[node])
            node = parents[node]
        out[tuple(reversed(path))] = i
    return out


# ----------------------------------------------------------------------------- (a) steep costs
STEEP = [CostProfile.linear(1.0), CostProfile(sizes=[1, 2], contexts=[0], times=[[1.0, 2.0]])]


@pytest.mark.parametrize("profile", STEEP, ids=["linear-1", "t2-is-2t1"])
@pytest.mark.parametrize("shape", [_chain_candidates, _bushy_candidates])
def test_steep_cost_and_low_estimates_draft_nothing(profile, shape):
    candidates = shape(40, 0.3)
    tree, chosen = choose(candidates, profile, context_len=100)
    assert len(tree) == 0 and len(chosen.probs) == 0 and chosen.expected == 0.0
    # Even certain acceptance cannot beat one-token steps when every token costs a full step.
    assert len(choose(_chain_candidates(10, 1.0), profile, 0)[0]) == 0


def test_moderate_cost_drafts_only_what_pays():
    # t(N) = 1 + 0.1 (N - 1): a node is worth drafting while its path probability beats ~0.1.
    candidates = _chain_candidates(30, 0.8)
    tree, chosen = choose(candidates, CostProfile.linear(0.1), 0)
    assert 0 < len(tree) < 30
    path = 0.8 ** np.arange(1, 31)
    assert chosen.expected == pytest.approx(path[: len(tree)].sum())


# ----------------------------------------------------------------------------- (b) flat costs
@pytest.mark.parametrize("shape", [_chain_candidates, _bushy_candidates])
def test_flat_cost_drafts_every_candidate(shape):
    candidates = shape(80, 0.5 if shape is _bushy_candidates else 0.95)
    tree, chosen = choose(candidates, CostProfile.flat(), 500)
    assert len(tree) == 80
    assert len(choose(candidates, CostProfile.flat(), 500, cap=63)[0]) == 63
    assert len(choose(candidates, None, 500)[0]) == 80  # no cost: the whole budget
    assert len(choose(candidates, None, 500, cap=10)[0]) == 10
    assert chosen.expected == pytest.approx(candidates.path_probs().sum())


def test_no_candidates_give_an_empty_tree():
    tree, chosen = choose(Candidates([], [], [], [], []), CostProfile.flat(), 0)
    assert len(tree) == 0 and chosen.expected == 0.0 and not chosen.cells


# ----------------------------------------------------------------------------- (c) every prefix is a tree
PROBS = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.floats(0.0, 1.0))


@st.composite
def candidate_trees(draw) -> Candidates:
    n = draw(st.integers(0, 40))
    tokens, parents, depths, seen = [], [], [], set()
    for i in range(n):
        parent = draw(st.integers(ROOT, i - 1))
        token = draw(st.integers(0, 5))
        while (parent, token) in seen:  # siblings carry distinct tokens
            token += 1
        seen.add((parent, token))
        tokens.append(token)
        parents.append(parent)
        depths.append(1 if parent == ROOT else depths[parent] + 1)
    probs = draw(st.lists(PROBS, min_size=n, max_size=n))
    return Candidates(tokens, parents, depths, probs, list(range(n)))


@settings(max_examples=100, deadline=None)
@given(candidates=candidate_trees())
def test_every_prefix_of_the_order_is_a_valid_subtree(candidates):
    n = len(candidates)
    by_path = _candidate_paths(candidates)
    path_probs = candidates.path_probs()
    previous: set[tuple[int, ...]] = set()
    for cap in range(n + 1):
        tree, chosen = choose(candidates, None, 0, cap=cap)
        assert len(tree) == cap
        # Parents before children, and depths consistent with them (the constructor validates).
        checked = DraftTree(tree.tokens, tree.parents)
        assert checked.depths.tolist() == tree.depths.tolist()
        paths = _paths(tree)
        assert len(set(paths)) == cap
        # Every drafted path is a candidate path with the same tokens; the prefix only grows.
        assert all(path in by_path for path in paths)
        assert previous <= set(paths)
        previous = set(paths)
        picked = [by_path[path] for path in paths]
        # The drafted nodes are the `cap` most probable paths.
        top = np.sort(path_probs)[::-1][:cap]
        assert np.sort(path_probs[picked])[::-1] == pytest.approx(top)
        # What the proposer learns from lines up with the drafted nodes.
        assert _list(chosen.probs) == [_list(candidates.probs)[i] for i in picked]
        assert _list(chosen.cells) == [_list(candidates.cells)[i] for i in picked]
        assert chosen.expected == pytest.approx(path_probs[picked].sum())


@settings(max_examples=60, deadline=None)
@given(candidates=candidate_trees(), slope=st.floats(0.0, 2.0), context=st.integers(0, 2000))
def test_any_cost_gives_a_valid_subtree_of_candidate_paths(candidates, slope, context):
    by_path = _candidate_paths(candidates)
    tree, chosen = choose(candidates, CostProfile.linear(slope), context)
    DraftTree(tree.tokens, tree.parents)
    assert all(path in by_path for path in _paths(tree))
    # The size is the best prefix of the ordered path probabilities.
    order = np.sort(candidates.path_probs())[::-1]
    assert len(tree) == best_size(order, CostProfile.linear(slope), context)


def test_path_probs_multiply_down_the_tree():
    candidates = Candidates([1, 2, 3, 4], [ROOT, 0, 1, ROOT], [1, 2, 3, 1], [0.5, 0.4, 1.0, 0.9], [0, 1, 2, 3])
    assert candidates.path_probs() == pytest.approx([0.5, 0.2, 0.2, 0.9])
    tree, _ = choose(candidates, None, 0)
    # 0.9 first; the tie between node 1 (depth 2) and its child (depth 3) goes to the parent.
    assert _paths(tree) == [(4,), (1,), (1, 2), (1, 2, 3)]


# ----------------------------------------------------------------------------- (d) best_size
@st.composite
def cost_profiles(draw) -> CostProfile:
    sizes = sorted(draw(st.sets(st.integers(1, 80), min_size=1, max_size=6)))
    contexts = sorted(draw(st.sets(st.integers(0, 4000), min_size=1, max_size=3)))
    times = [[draw(st.floats(0.01, 10.0)) for _ in sizes] for _ in contexts]
    return CostProfile(sizes=sizes, contexts=contexts, times=times)


@settings(max_examples=150, deadline=None)
@given(probs=st.lists(PROBS, max_size=50), profile=cost_profiles(), context=st.integers(0, 5000),
       cap=st.one_of(st.none(), st.integers(0, 60)))
def test_best_size_maximises_tokens_per_second(probs, profile, context, cap):
    path = np.sort(np.asarray(probs, dtype=np.float64))[::-1]
    size = best_size(path, profile, context, cap)
    n_max = len(path) if cap is None else min(cap, len(path))
    assert 0 <= size <= n_max

    def value(n: int) -> float:
        return (1.0 + float(sum(path[:n]))) / float(profile.predict(1 + n, context))

    best = max(value(n) for n in range(n_max + 1))
    assert value(size) >= best * (1 - 1e-12)
    assert best_size(path, None, context, cap) == n_max


# ----------------------------------------------------------------------------- (e) add_chain
def test_add_chain_shares_nodes_keeps_the_max_and_both_cells():
    # root -> 10 -> 11, root -> 20
    candidates = Candidates([10, 11, 20], [ROOT, 0, ROOT], [1, 2, 1], [0.3, 0.6, 0.2], [7, 8, 9])
    candidates.add_chain([10, 11, 12, 13], [0.9, 0.1, 0.5, 0.4], [100, 101, 102, 103])
    assert len(candidates) == 5  # 10 and 11 shared, 12 and 13 new
    assert _list(candidates.tokens) == [10, 11, 20, 12, 13]
    assert _list(candidates.parents) == [ROOT, 0, ROOT, 1, 3]
    assert _list(candidates.depths) == [1, 2, 1, 3, 4]
    assert _list(candidates.probs) == [0.9, 0.6, 0.2, 0.5, 0.4]  # the higher estimate of each shared node
    assert _list(candidates.cells) == [[7, 100], [8, 101], [9], [102], [103]]  # labelled for both sources
    # A second chain sharing the new nodes too, then one diverging at the root.
    candidates.add_chain([10, 11, 12], [0.1, 0.7, 0.2], [200, 201, 202])
    candidates.add_chain([30], [0.5], [300])
    assert len(candidates) == 6
    assert _list(candidates.probs)[:5] == [0.9, 0.7, 0.2, 0.5, 0.4]
    assert _list(candidates.cells)[3] == [102, 202] and _list(candidates.cells)[5] == [300]
    assert _list(candidates.cells)[0] == [7, 100, 200]  # three sources at most, all kept
    assert candidates.parents[5] == ROOT and candidates.depths[5] == 1
    tree, chosen = choose(candidates, None, 0)
    assert sorted(_paths(tree)) == sorted(_candidate_paths(candidates))
    # labelled_cells flattens the cells of labelled nodes and says how many each had.
    labelled = np.ones(len(tree), dtype=bool)
    flat, repeats, _ = chosen.labelled_cells(labelled)
    assert repeats.sum() == len(flat) == sum(len(c) for c in candidates.cells)


def test_add_chain_into_an_empty_candidate_set_builds_a_chain():
    candidates = Candidates([], [], [], [], [])
    candidates.add_chain([5, 6, 7], [0.5, 0.5, 0.5], [1, 2, 3])
    assert _list(candidates.parents) == [ROOT, 0, 1] and _list(candidates.depths) == [1, 2, 3]
    assert candidates.path_probs() == pytest.approx([0.5, 0.25, 0.125])
    candidates.add_chain([], [], [])
    assert len(candidates) == 3


# ----------------------------------------------------------------------------- (f) host cost
def test_choosing_asks_the_cost_model_once_for_all_sizes():
    """Host cost without a clock: the prefix choice is vectorised over sizes, so choosing
    among a few hundred nodes asks the cost model for one curve, not once per size, and
    steps at the same context length do not ask again."""
    calls = []

    class Counting(CostProfile):
        def predict(self, n_packed, context_len=0):
            calls.append(np.size(n_packed))
            return super().predict(n_packed, context_len)

    profile = Counting(sizes=[1, 64], contexts=[0], times=[[1.0, 2.0]])
    candidates = _bushy_candidates(400, 0.7)
    for _ in range(10):
        tree, _ = choose(candidates, profile, 0)
        assert 0 < len(tree) <= 400
    assert 1 <= len(calls) <= 10 and all(size >= 401 for size in calls)


def test_nodes_deeper_than_the_request_can_use_are_never_drafted():
    # A certain 10-token chain, but the request may commit only 4 more tokens: depth 3 at most.
    candidates = Candidates(list(range(10)), [-1, *range(9)], list(range(1, 11)), [0.99] * 10, [0] * 10)
    tree, chosen = choose(candidates, CostProfile.flat(), 0, max_depth=3)
    assert len(tree) == 3 and max(tree.depths) == 3
    tree, _ = choose(candidates, None, 0, cap=8, max_depth=3)  # a fixed budget too
    assert len(tree) == 3
    tree, _ = choose(candidates, CostProfile.flat(), 0)
    assert len(tree) == 10


# ----------------------------------------------------------------------------- (e) the request's end
# A cost curve of the measured kind: flat to a few rows, then near linear, with a step at 33.
NEAR_LINEAR = CostProfile(sizes=[1, 2, 4, 8, 16, 32, 33, 64], contexts=[0],
                          times=[[0.0316, 0.036, 0.036, 0.052, 0.085, 0.156, 0.169, 0.299]])


def _uniform_chain(prob: float, n: int = 64) -> Candidates:
    return Candidates(list(range(n)), [ROOT, *range(n - 1)], list(range(1, n + 1)), [prob] * n, [0] * n)


def _time_to_finish(prob: float, tokens: int, profile: CostProfile, size_for) -> np.ndarray:
    """Expected seconds to commit 1..``tokens`` tokens drafting a chain of i.i.d. ``prob``
    nodes, ``size_for(remaining)`` nodes a step (None: the best size, by dynamic programming)."""
    expected = np.zeros(tokens + 1)

    def cost(n: int, remaining: int) -> float:
        accepted = [prob**a * (1 - prob) for a in range(n)] + [prob**n]  # exactly a drafts accepted
        return float(profile.predict(n + 1, 0)) + sum(q * expected[remaining - 1 - a] for a, q in enumerate(accepted))

    for remaining in range(1, tokens + 1):
        sizes = range(remaining) if size_for is None else [size_for(remaining)]
        expected[remaining] = min(cost(n, remaining) for n in sizes)
    return expected[1:]


def test_a_certain_chain_that_finishes_the_request_is_drafted_whole():
    # The measured case: 33 tokens left, a 33-token exact repeat. Priced as one step of many,
    # 31 nodes look best (t(33) jumps), leaving 2 tokens for a third step; credited with the
    # step it saves, the chain finishes the request now.
    tree, _ = choose(_uniform_chain(0.99), NEAR_LINEAR, 0, max_depth=33, end_aware=False)
    assert len(tree) < 33
    tree, _ = choose(_uniform_chain(0.99), NEAR_LINEAR, 0, max_depth=33)
    assert len(tree) == 33
    # Far from the end nothing changes.
    assert len(choose(_uniform_chain(0.99), NEAR_LINEAR, 0)[0]) == \
        len(choose(_uniform_chain(0.99), NEAR_LINEAR, 0, end_aware=False)[0])


@pytest.mark.parametrize("profile", [NEAR_LINEAR, CostProfile(sizes=[1, 4, 8, 16, 64], contexts=[0],
                                                               times=[[0.0211, 0.0216, 0.0293, 0.05, 0.18]])],
                         ids=["near-linear", "flat-to-4"])
@pytest.mark.parametrize("prob", [0.9, 0.95, 0.98])
def test_the_end_aware_choice_is_closer_to_the_optimal_policy(profile, prob):
    # Against the exact optimum (dynamic programming over the tokens left), the end-aware
    # chooser's expected time to finish a request of 1..64 tokens is nearer on average and in
    # the worst case than the per-step rate alone; it would tie if the credit did nothing.
    def size(end_aware: bool):
        return lambda remaining: len(choose(_uniform_chain(prob), profile, 0, max_depth=remaining - 1,
                                            end_aware=end_aware)[0])

    best = _time_to_finish(prob, 64, profile, None)
    plain = _time_to_finish(prob, 64, profile, size(False)) / best
    aware = _time_to_finish(prob, 64, profile, size(True)) / best
    assert plain.min() >= 1 - 1e-9 and aware.min() >= 1 - 1e-9  # the optimum is a lower bound
    assert aware.mean() < plain.mean() and aware.max() < plain.max()


EOS = 999


def _chain_ending_in_eos(prob: float, length: int, tail: int = 10) -> Candidates:
    """A chain of ``length`` tokens whose last is EOS, then ``tail`` tokens past it (the
    quoted turn's template), every node ``prob``."""
    tokens = [*range(length - 1), EOS, *range(1000, 1000 + tail)]
    n = len(tokens)
    return Candidates(tokens, [ROOT, *range(n - 1)], list(range(1, n + 1)), [prob] * n, [0] * n)


def test_nodes_below_a_stop_token_are_never_drafted():
    # Past EOS nothing is committed: a flat cost drafts every other node, none below EOS.
    candidates = _chain_ending_in_eos(0.99, 20)
    tree, _ = choose(candidates, CostProfile.flat(), 0, stop_tokens=frozenset({EOS}))
    assert len(tree) == 20 and int(tree.tokens[-1]) == EOS
    assert len(choose(candidates, CostProfile.flat(), 0)[0]) == 30  # the control: without the stop set


def test_a_chain_that_ends_in_eos_is_credited_with_the_step_it_saves():
    # A 28-token repeat ending in EOS, far from the token limit: priced as one step of many,
    # the chain is cut short; credited like a path that reaches the limit, it is drafted whole
    # (the request ends in this step), and never past the EOS.
    candidates = _chain_ending_in_eos(0.98, 28)
    plain, _ = choose(candidates, NEAR_LINEAR, 0, max_depth=62, stop_tokens=frozenset({EOS}), end_aware=False)
    aware, _ = choose(candidates, NEAR_LINEAR, 0, max_depth=62, stop_tokens=frozenset({EOS}))
    assert len(plain) < 28
    assert len(aware) == 28 and int(aware.tokens[-1]) == EOS


def test_a_stop_token_below_another_stops_its_whole_subtree():
    # EOS at depth 2 on one branch; its grandchildren are cut, the sibling branch is not.
    tokens = [1, EOS, 5, 6, 2, 3]
    parents = [ROOT, 0, 1, 2, ROOT, 4]
    depths = [1, 2, 3, 4, 1, 2]
    candidates = Candidates(tokens, parents, depths, [0.9] * 6, [0] * 6)
    tree, _ = choose(candidates, CostProfile.flat(), 0, stop_tokens=frozenset({EOS}))
    assert sorted(_paths(tree)) == sorted([(1,), (1, EOS), (2,), (2, 3)])
