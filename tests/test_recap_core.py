"""RECAP's memory, fusion and best-first tree against hand-computed cases: memory and fusion
on the pure-Python oracle (`tests/reference_recap.py`, which `tests/test_fast.py` ties to the
engine bit for bit), trees on the production proposer."""

import math

import numpy as np
import pytest

from recap.core import ROOT, DraftTree, PromptRows, VerifiedTree
from recap.proposers.recap import RecapPaperProposer
from tests.reference_recap import PredictionMemory, make_row, plant_unigram, rows_from_logits
from tests.reference_recap import fuse as fuse_rows


def entropy_confidence(probs):
    return math.exp(sum(p * math.log(p) for p in probs if p > 0))


def fuse(*args, **kwargs):
    """The fusion under test, with list outputs for easy comparison."""
    tokens, probs = fuse_rows(*args, **kwargs)
    return list(tokens), list(probs)


def row(ids, probs):
    return make_row(tuple(ids), tuple(probs), entropy_confidence(probs))


# ----------------------------------------------------------------------------- rows
def test_rows_from_logits_softmax_over_kept_logits_and_confidence():
    (first, second) = rows_from_logits(np.array([[4, 9], [1, 2]]), np.array([[0.0, 0.0], [math.log(3.0), 0.0]]))
    assert first[0] == (4, 9) and first[1] == pytest.approx((0.5, 0.5))
    assert first[2] == pytest.approx(0.5)  # exp(-ln 2): effective support 2
    assert second[1] == pytest.approx((0.75, 0.25))
    assert second[2] == pytest.approx(math.exp(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))


# ----------------------------------------------------------------------------- fusion
def test_one_row_is_plain_lookup():
    single = row([7, 3, 5], [0.5, 0.3, 0.2])
    assert fuse([single], k=8) == ([7, 3, 5], pytest.approx([0.5, 0.3, 0.2]))
    assert fuse([], k=8) == ([], [])


def test_two_rows_take_the_first_two_priors():
    specific = row([1, 2], [0.5, 0.5])  # c = 0.5
    general = row([2, 3], [0.8, 0.2])
    c_general = entropy_confidence([0.8, 0.2])
    w1, w2 = 0.7 * 0.5, 0.2 * c_general
    w1, w2 = w1 / (w1 + w2), w2 / (w1 + w2)
    tokens, probs = fuse([specific, general], k=8)
    expected = {1: w1 * 0.5, 2: w1 * 0.5 + w2 * 0.8, 3: w2 * 0.2}
    assert tokens == [2, 1, 3]
    assert probs == pytest.approx([expected[t] for t in tokens])


def test_three_rows_and_top_k_renormalises():
    g, c, u = row([1, 2], [0.9, 0.1]), row([3, 4], [0.6, 0.4]), row([5, 6], [0.5, 0.5])
    weights = [0.7 * g[2], 0.2 * c[2], 0.1 * u[2]]
    total = sum(weights)
    mixture = {1: 0.9 * weights[0], 2: 0.1 * weights[0], 3: 0.6 * weights[1], 4: 0.4 * weights[1],
               5: 0.5 * weights[2], 6: 0.5 * weights[2]}
    mixture = {t: m / total for t, m in mixture.items()}
    top3 = sorted(mixture, key=lambda t: -mixture[t])[:3]
    tokens, probs = fuse([g, c, u], k=3)
    assert tokens == top3
    kept = sum(mixture[t] for t in top3)
    assert probs == pytest.approx([mixture[t] / kept for t in top3])
    assert sum(probs) == pytest.approx(1.0)


def test_ties_keep_the_more_specific_rows_order():
    # Same confidence, priors 0.7/0.2 on tokens with masses chosen to tie exactly.
    a = make_row((1, 2), (0.2, 0.8), 1.0)
    b = make_row((3, 4), (0.7, 0.3), 1.0)
    tokens, probs = fuse([a, b], k=4, mode="uniform")
    # uniform: w = 0.5 each: 1 -> 0.1, 2 -> 0.4, 3 -> 0.35, 4 -> 0.15
    assert tokens == [2, 3, 4, 1]
    tie_a, tie_b = make_row((10,), (1.0,), 1.0), make_row((20,), (1.0,), 1.0)
    assert fuse([tie_a, tie_b], k=2, mode="uniform")[0] == [10, 20]
    assert fuse([tie_b, tie_a], k=2, mode="uniform")[0] == [20, 10]


def test_a_peaked_short_row_beats_a_diffuse_long_row():
    diffuse = row(list(range(100, 108)), [1 / 8] * 8)  # most specific, c = 1/8
    peaked = row([7, 8], [0.95, 0.05])  # less specific, nearly certain
    w_diffuse, w_peaked = 0.7 * (1 / 8), 0.2 * peaked[2]
    total = w_diffuse + w_peaked
    mixture = {t: w_diffuse / total / 8 for t in range(100, 108)}
    mixture[7] = w_peaked / total * 0.95
    mixture[8] = w_peaked / total * 0.05  # 0.0082 < 0.0109 of each diffuse token: cut by Top-8
    top8 = [7, *range(100, 107)]
    tokens, probs = fuse([diffuse, peaked], k=8)
    assert tokens == top8
    assert probs[0] == pytest.approx(mixture[7] / sum(mixture[t] for t in top8))
    assert probs[0] > 0.6
    # Without confidence the specific prior dominates far more: the peaked token keeps only ~0.21.
    no_conf_tokens, no_conf_probs = fuse([diffuse, peaked], k=8, mode="no-confidence")
    assert no_conf_tokens[0] == 7 and no_conf_probs[0] < 0.25 < probs[0]


def test_ablation_modes():
    g = make_row((1,), (1.0,), 0.3)
    c = make_row((2,), (1.0,), 0.9)
    u = make_row((3,), (1.0,), 0.9)
    assert fuse([g, c, u], mode="gate")[0] == [2]  # most confident; tie with U goes to the more specific C
    assert fuse([g, c, u], mode="backoff")[0] == [1]
    no_prior = fuse([g, c, u], mode="no-prior")
    assert no_prior[1] == pytest.approx([0.9 / 2.1, 0.9 / 2.1, 0.3 / 2.1])
    uniform = fuse([g, c, u], mode="uniform")
    assert uniform[1] == pytest.approx([1 / 3] * 3)


# ----------------------------------------------------------------------------- memory
def _prompt(ids, eligible=None, vocab=1000):
    ids = np.array(ids)
    n = len(ids)
    topk_ids = (np.arange(n)[:, None] * 10 + np.arange(2)[None]).astype(np.int64)  # row p: (10p, 10p+1)
    return PromptRows(ids=ids, topk_ids=topk_ids, topk_logits=np.zeros((n, 2), np.float32),
                      eligible=np.ones(n, bool) if eligible is None else np.array(eligible), vocab_size=vocab,
                      excluded_tokens=frozenset({999}))


def test_prefill_seeds_unigram_at_first_eligible_occurrence():
    memory = PredictionMemory()
    memory.seed_from_prompt(_prompt([5, 6, 5, 999, 7], eligible=[True, False, True, False, True]))
    assert set(memory.unigram) == {5, 7}
    assert memory.unigram[5][0] == (0, 1)  # first occurrence (position 0), not position 2
    assert memory.unigram[7][0] == (40, 41)
    assert not memory.bigram and not memory.trigram


def _step(tree, ids_per_node):
    n = len(tree) + 1
    topk_ids = np.array(ids_per_node, dtype=np.int64).reshape(n, -1)
    return VerifiedTree(tree=tree, topk_ids=topk_ids, topk_logits=np.zeros(topk_ids.shape, np.float32),
                        argmax=topk_ids[:, 0], accepted=[])


def test_refresh_writes_every_node_under_its_path_context():
    memory = PredictionMemory()
    history = [1, 2, 3]  # root token 3
    tree = DraftTree([4, 5, 6], [ROOT, 0, ROOT])  # 3 -> 4 -> 5, and 3 -> 6 (rejected or not: all written)
    memory.refresh(history, _step(tree, [[30], [40], [50], [60]]))
    assert memory.unigram[3][0] == (30,) and memory.unigram[4][0] == (40,)
    assert memory.unigram[5][0] == (50,) and memory.unigram[6][0] == (60,)
    assert memory.bigram[(2, 3)][0] == (30,) and memory.bigram[(3, 4)][0] == (40,)
    assert memory.bigram[(4, 5)][0] == (50,) and memory.bigram[(3, 6)][0] == (60,)
    assert memory.trigram[(1, 2, 3)][0] == (30,) and memory.trigram[(2, 3, 4)][0] == (40,)
    assert memory.trigram[(3, 4, 5)][0] == (50,) and memory.trigram[(2, 3, 6)][0] == (60,)


def test_first_occurrence_in_a_batch_wins_and_newer_batches_replace():
    memory = PredictionMemory()
    tree = DraftTree([9, 9], [ROOT, 0])  # root 9 -> 9 -> 9: U[9] written three times in one batch
    memory.refresh([8, 9], _step(tree, [[1], [2], [3]]))
    assert memory.unigram[9][0] == (1,)  # the root's row came first
    assert memory.bigram[(9, 9)][0] == (2,)
    memory.refresh([7, 9], _step(DraftTree.empty(), [[5]]))
    assert memory.unigram[9][0] == (5,)  # a newer iteration replaces
    assert memory.bigram[(9, 9)][0] == (2,)


def test_request_reset_clears_contextual_maps_but_keeps_unigram():
    memory = PredictionMemory()
    memory.refresh([1, 2, 3], _step(DraftTree([4], [ROOT]), [[1], [2]]))
    memory.reset_request()
    assert memory.unigram and not memory.bigram and not memory.trigram
    memory.reset_stream()
    assert len(memory) == 0


# ----------------------------------------------------------------------------- tree
def _proposer_with_unigram(rows, **config):
    """The paper's tree (recap-paper): these cases pin its best-first order and suffix rule.
    U holds exactly ``rows`` (the prompt's own seeding is cleared)."""
    proposer = RecapPaperProposer(suffix_tokens=0, **config)
    proposer.begin_request(_prompt([500, 501]))
    proposer.memory.reset_stream()
    plant_unigram(proposer.memory, rows)
    return proposer


HAND_ROWS = {
    3: make_row((10, 11), (0.6, 0.4), 1.0),
    10: make_row((20, 21), (0.9, 0.1), 1.0),
    11: make_row((30,), (1.0,), 1.0),
}


def test_best_first_order_by_hand():
    # Scores: 10 .68*.6=.408 | 11 .68*.4=.272 | 20 .408*.63*.9=.231 | 30 .272*.63=.171 | 21 .408*.63*.1=.026
    proposer = _proposer_with_unigram(HAND_ROWS, budget=5)
    tree = proposer.propose([1, 2, 3])
    assert tree.tokens.tolist() == [10, 11, 20, 30, 21]
    assert tree.parents.tolist() == [ROOT, ROOT, 0, 1, 0]
    assert _proposer_with_unigram(HAND_ROWS, budget=3).propose([1, 2, 3]).tokens.tolist() == [10, 11, 20]


def test_depth_width_and_excluded_tokens_limit_the_tree():
    assert _proposer_with_unigram(HAND_ROWS, max_depth=1).propose([3]).tokens.tolist() == [10, 11]
    assert _proposer_with_unigram(HAND_ROWS, width=1).propose([3]).tokens.tolist() == [10, 20]
    rows = {3: make_row((999, 11), (0.6, 0.4), 1.0), 11: make_row((30,), (1.0,), 1.0)}
    assert _proposer_with_unigram(rows).propose([3]).tokens.tolist() == [11, 30]  # image token 999 dropped
    assert len(_proposer_with_unigram({}).propose([3])) == 0


def test_deeper_context_uses_fused_rows():
    proposer = _proposer_with_unigram({3: make_row((10,), (1.0,), 1.0)}, budget=2)
    # A verification with root 10 after (3, 10) writes C[3, 10] (and U[10]); then U[10] is replaced.
    proposer.memory.refresh((-1, 3, 10), np.zeros(0, np.int64), np.zeros(0, np.int64), np.array([[40]]),
                            np.zeros((1, 1), np.float32))
    plant_unigram(proposer.memory, {10: make_row((41,), (1.0,), 1.0)})
    assert proposer.memory.table("bigram") == {(3, 10): ((40,), (1.0,), 1.0)}
    tree = proposer.propose([2, 3])
    # Under context (3, 10): C[3,10] and U[10] fuse with priors 0.7/0.2 -> 40 first.
    assert tree.tokens.tolist() == [10, 40]


def test_suffix_continuation_shares_the_tree_prefix():
    proposer = RecapPaperProposer(budget=2)
    # Prompt 1 3 10 20 99 7 ... then history ends with 3: the automaton continues 10 20 99 7.
    proposer.begin_request(_prompt([1, 3, 10, 20, 99, 7, 8]))
    proposer.memory.reset_stream()
    plant_unigram(proposer.memory, {3: make_row((10,), (1.0,), 1.0), 10: make_row((20,), (1.0,), 1.0)})
    tree = proposer.propose([1, 3, 10, 20, 99, 7, 8, 3])
    assert tree.tokens.tolist() == [10, 20, 99, 7]
    assert tree.parents.tolist() == [ROOT, 0, 1, 2]  # 10 and 20 reused, 99 and 7 appended
    assert len(tree) == 2 + 2  # budget 2 plus suffix nodes beyond the cap
