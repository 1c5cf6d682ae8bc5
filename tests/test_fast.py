"""RECAP's engine (`recap.core.fast.FastMemory`) against the pure-Python oracle
(`tests/reference_recap.py`).

Same operations on both (prompt seeding, refreshes, contextual or not, request and stream
resets), then: identical U/C/G contents, and identical trees from ``build_tree`` for random
contexts under every fusion mode, budget, depth, width, Top-K and excluded set. Small
vocabularies and tied logits make key collisions, equal masses and equal heap scores common.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recap.core import DraftTree, PromptRows, VerifiedTree
from recap.core.fast import FUSION_CODES, FUSION_MODES, FastMemory, context_of, fusion_code
from recap.proposers.recap import RecapConfig, RecapPaperProposer
from tests.reference_recap import PredictionMemory, ReferenceSearch

MODES = list(FUSION_CODES)
ETA_CHOICES = [
    {},  # paper defaults
    {"depth_priors": (0.5,), "tail_depth_prior": 0.5},  # equal etas: more equal scores
    {"depth_priors": (1.0, 0.25, 1.0), "tail_depth_prior": 0.75},
]
PRIOR_CHOICES = [(0.70, 0.20, 0.10), (1 / 3, 1 / 3, 1 / 3), (0.5, 0.5, 0.25)]


# ----------------------------------------------------------------------------- the workload
class World:
    """One random vocabulary, row shape and token pool; applies operations to both memories."""

    def __init__(self, rng: np.random.Generator, vocab: int, pool: int, width: int, store_k: int,
                 distinct: bool, sorted_logits: bool, tie_levels: int, spread: bool = False):
        self.rng = rng
        self.vocab = vocab
        self.tokens = rng.choice(vocab, size=min(pool, vocab), replace=False).astype(np.int64)
        self.width = width
        self.distinct = distinct and len(self.tokens) >= width
        self.sorted_logits = sorted_logits
        self.tie_levels = tie_levels
        self.spread = spread
        self.reference = PredictionMemory()
        self.fast = FastMemory(vocab, store_k)

    def token(self) -> int:
        return int(self.rng.choice(self.tokens))

    def history(self) -> list[int]:
        return [self.token() for _ in range(int(self.rng.integers(1, 4)))]

    def topk(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        rng = self.rng
        if self.distinct:
            ids = np.stack([rng.choice(self.tokens, size=self.width, replace=False) for _ in range(n)])
        else:
            ids = rng.choice(self.tokens, size=(n, self.width))
        if self.tie_levels:
            logits = rng.integers(0, self.tie_levels, size=(n, self.width)).astype(np.float32)
        else:
            logits = (3 * rng.standard_normal((n, self.width))).astype(np.float32)
        if self.spread:  # probabilities that underflow to 0
            logits[rng.random(logits.shape) < 0.2] = -1e4
        if self.sorted_logits:
            logits = -np.sort(-logits, axis=1)
        return ids.reshape(n, self.width).astype(np.int64), logits

    def tree(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        parents = np.array([int(self.rng.integers(-1, i)) for i in range(n)], dtype=np.int64)
        return np.array([self.token() for _ in range(n)], dtype=np.int64), parents

    # -------------------------------------------------------------- operations
    def seed(self) -> None:
        n = int(self.rng.integers(1, 30))
        ids = self.rng.choice(self.tokens, size=n).astype(np.int64)
        eligible = self.rng.random(n) < 0.8
        topk_ids, topk_logits = self.topk(n)
        self.reference.seed_from_prompt(PromptRows(ids=ids, topk_ids=topk_ids, topk_logits=topk_logits,
                                                   eligible=eligible, vocab_size=self.vocab,
                                                   excluded_tokens=frozenset()))
        self.fast.seed_from_prompt(ids, topk_ids, topk_logits, eligible)

    def refresh(self, contextual: bool, size: int | None = None) -> None:
        history = self.history()
        n = int(self.rng.integers(0, 16)) if size is None else size
        tokens, parents = self.tree(n)
        topk_ids, topk_logits = self.topk(n + 1)
        step = VerifiedTree(tree=DraftTree(tokens, parents), topk_ids=topk_ids, topk_logits=topk_logits,
                            argmax=np.zeros(n + 1, dtype=np.int64), accepted=[])
        self.reference.refresh(history, step, contextual=contextual)
        self.fast.refresh(context_of(history), tokens, parents, topk_ids, topk_logits, contextual=contextual)

    def apply(self, op: str) -> None:
        if op == "seed":
            self.seed()
        elif op == "refresh":
            self.refresh(True)
        elif op == "refresh-U":
            self.refresh(False)
        elif op == "reset-request":
            self.reference.reset_request()
            self.fast.reset_request()
        else:
            self.reference.reset_stream()
            self.fast.reset_stream()

    # -------------------------------------------------------------- checks
    def assert_same_contents(self) -> None:
        reference = {"unigram": {(k,): r for k, r in self.reference.unigram.items()},
                     "bigram": self.reference.bigram, "trigram": self.reference.trigram}
        for name, expected in reference.items():
            got = self.fast.table(name)
            assert set(got) == set(expected), name
            for key, (ids, probs, confidence) in expected.items():
                got_ids, got_probs, got_confidence = got[key]
                assert got_ids == tuple(ids), (name, key)
                assert got_probs == tuple(probs), (name, key)  # same numpy expressions: same bits
                assert got_confidence == confidence, (name, key)
        assert self.fast.counts() == (len(self.reference.unigram), len(self.reference.bigram),
                                      len(self.reference.trigram))
        assert len(self.fast) == len(self.reference)

    def assert_same_tree(self, history: list[int], excluded: frozenset[int], **config) -> None:
        search = ReferenceSearch(RecapConfig(suffix_tokens=0, **config), self.reference, excluded)
        try:
            builder, reference_q = search.build_tree(list(history))
        except ZeroDivisionError:  # a row whose kept probabilities sum to 0 (not sorted highest first)
            builder = None
        mask = None
        if excluded:
            mask = np.zeros(self.vocab, dtype=bool)
            mask[list(excluded)] = True
        c = search.config
        mode = c.fusion if self.rng.random() < 0.5 else FUSION_CODES[c.fusion]
        arguments = (context_of(history), c.budget, c.max_depth, c.width, c.top_k, np.array(search.etas),
                     np.array(c.priors), mode, mask)
        if builder is None:
            with pytest.raises(ZeroDivisionError):
                self.fast.build_tree(*arguments)
            return
        tokens, parents, depths, q = self.fast.build_tree(*arguments)
        assert tokens.dtype == parents.dtype == depths.dtype == np.int64
        got = (tokens.tolist(), parents.tolist(), depths.tolist())
        assert got == (builder.tokens, builder.parents, builder.depths), (history, sorted(excluded), config)
        # q: each node's fused probability under its parent's context, as the reference has it.
        assert q.dtype == np.float64 and len(q) == len(reference_q)
        np.testing.assert_allclose(q, reference_q, rtol=1e-12, atol=0)

    def random_config(self, mode: str) -> dict:
        rng = self.rng
        return {"fusion": mode, "budget": int(rng.choice([0, 1, 2, 5, 17, 63])),
                "max_depth": int(rng.integers(1, 8)), "width": int(rng.integers(1, 9)),
                "top_k": int(rng.integers(1, 9)), "priors": PRIOR_CHOICES[int(rng.integers(len(PRIOR_CHOICES)))],
                **ETA_CHOICES[int(rng.integers(len(ETA_CHOICES)))]}

    def random_excluded(self) -> frozenset[int]:
        if self.rng.random() < 0.5:
            return frozenset()
        count = int(self.rng.integers(1, max(2, len(self.tokens) // 3)))
        return frozenset(int(t) for t in self.rng.choice(self.tokens, size=count))

    def assert_same_trees(self, trials: int) -> None:
        for trial in range(trials):
            mode = MODES[trial % len(MODES)]
            history = self.history()
            if self.rng.random() < 0.1:
                history = [int(self.rng.integers(0, self.vocab))]  # likely no row at all
            self.assert_same_tree(history, self.random_excluded(), **self.random_config(mode))


worlds = st.fixed_dictionaries({
    "seed": st.integers(0, 2**32 - 1),
    "vocab": st.one_of(st.integers(5, 20), st.sampled_from([257, 49152, 152064, 200000])),
    "pool": st.integers(3, 40),
    "width": st.integers(1, 8),
    "extra_k": st.integers(0, 2),
    "distinct": st.booleans(),
    "sorted_logits": st.booleans(),
    "tie_levels": st.sampled_from([0, 1, 2, 3]),
    "spread": st.booleans(),
})
OPS = ["seed", "refresh", "refresh", "refresh", "refresh-U", "reset-request", "reset-stream"]


def make_world(params: dict) -> World:
    return World(np.random.default_rng(params["seed"]), params["vocab"], params["pool"], params["width"],
                 params["width"] + params["extra_k"], params["distinct"], params["sorted_logits"],
                 params["tie_levels"], params.get("spread", False))


# ----------------------------------------------------------------------------- differential tests
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=worlds, ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=10))
def test_same_memory_and_same_trees_after_random_operations(params, ops):
    world = make_world(params)
    for op in ops:
        world.apply(op)
    world.assert_same_contents()
    world.assert_same_trees(trials=2 * len(MODES))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=worlds)
def test_long_stream_with_pool_compaction_and_growth(params):
    """Thousands of rows: the pool is compacted and grown many times along the way."""
    world = make_world(params)
    world.seed()
    bound = peak = world.fast.pool_rows[0]  # rows the pool may hold: U at the request start + new positions
    for step in range(60):
        size = int(world.rng.integers(10, 64))
        world.refresh(contextual=step % 7 != 3, size=size)
        bound += size + 1
        peak = max(peak, bound)
        used, capacity = world.fast.pool_rows
        assert used <= bound and capacity <= max(256, 2 * peak)  # doubling; the capacity is kept
        if step % 20 == 19:
            world.assert_same_contents()
            world.assert_same_trees(trials=len(MODES))
            world.reference.reset_request()
            world.fast.reset_request()
            assert world.fast.pool_rows[0] == len(world.reference.unigram)  # compacted to U's rows
            bound = len(world.reference.unigram)
    world.assert_same_contents()


def test_synthetic_decode_trajectory_matches_the_reference():
    """The production proposer's real loop on the synthetic target: every tree it proposes is
    the oracle's tree for the same history, and the oracle memory, fed the same prompts and
    verifications, ends equal to the proposer's."""
    from recap.overhead import SyntheticTarget

    target = SyntheticTarget(3000, seed=3)
    # The paper's configuration proposes exactly the searched tree (the cost-aware one reorders
    # and cuts it); the search's q is checked too.
    proposer = RecapPaperProposer(suffix_tokens=0)
    reference = ReferenceSearch(proposer.config)
    c = proposer.config
    proposer.reset_stream()
    iterations = 0
    for request in range(3):
        prompt = target.sample_prompt(48, seed=request)
        rows, first = target.prefill(prompt)
        proposer.begin_request(rows)
        reference.memory.reset_request()
        reference.memory.seed_from_prompt(rows)
        history = [*prompt, first]
        while len(history) < len(prompt) + 40:
            tree = proposer.propose(history)
            builder, reference_q = reference.build_tree(history[-3:])
            assert (builder.tokens, builder.parents, builder.depths) == (
                tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist())
            q = proposer.memory.build_tree(context_of(history), c.budget, c.max_depth, c.width, c.top_k,
                                           np.array(reference.etas), np.array(c.priors), c.fusion)[3]
            assert len(reference_q) == len(q) and np.all((q > 0) & (q <= 1))
            np.testing.assert_allclose(q, reference_q, rtol=1e-9, atol=1e-12)
            step = target.verify(history[-1], tree)
            target.commit(step.accepted)
            reference.memory.refresh(history, step)
            proposer.observe(step)
            history.extend(step.committed)
            iterations += 1
        proposer.end_request()
        reference.memory.reset_request()
        target.release()
    assert iterations > 20
    world = World.__new__(World)
    world.reference, world.fast = reference.memory, proposer.memory
    world.assert_same_contents()


# ----------------------------------------------------------------------------- persistence
def test_unigram_arrays_and_load_match_the_memory_file(tmp_path):
    from recap.core.persistence import read_token_memory, save_token_memory

    world = make_world({"seed": 5, "vocab": 400, "pool": 60, "width": 6, "extra_k": 2, "distinct": True,
                        "sorted_logits": True, "tie_levels": 0})
    for _ in range(6):
        world.seed()
        world.refresh(True)
    keys, ids, probs = world.fast.unigram_arrays()
    path = tmp_path / "u.safetensors"
    save_token_memory(path, *world.reference.unigram_arrays(), vocab_size=world.vocab)
    saved = read_token_memory(path)
    assert np.array_equal(keys, saved.keys) and np.array_equal(ids, saved.ids)
    assert np.array_equal(probs.astype(np.float32), saved.probs)
    # load == TokenMemoryFile.install, into a memory that already holds other rows
    world.reference.reset_stream()
    world.fast.reset_stream()
    world.seed()
    saved.install(world.reference, world.vocab)
    world.fast.load_unigram(saved.keys, saved.ids, saved.probs)
    world.assert_same_contents()
    world.assert_same_trees(trials=len(MODES))


# ----------------------------------------------------------------------------- the API
def test_fusion_codes_cover_the_reference_modes():
    assert set(FUSION_CODES) == set(FUSION_MODES)
    assert [fusion_code(name) for name in FUSION_CODES] == list(range(len(FUSION_CODES)))
    with pytest.raises(ValueError):
        fusion_code("nope")


def test_context_of_pads_with_minus_one():
    assert context_of([7]) == (-1, -1, 7)
    assert context_of([6, 7]) == (-1, 6, 7)
    assert context_of([1, 2, 3, 4]) == (2, 3, 4)


def test_bad_inputs_raise_and_write_nothing():
    fast = FastMemory(10, 2)
    ids, logits = np.array([[1, 2], [3, 4]]), np.zeros((2, 2))
    with pytest.raises(ValueError):
        fast.refresh((-1, -1, 3), np.array([10]), np.array([-1]), ids, logits)  # token outside the vocabulary
    with pytest.raises(ValueError):
        fast.refresh((-1, -1, 3), np.array([1]), np.array([0]), ids, logits)  # parent not earlier
    with pytest.raises(ValueError):
        fast.refresh((-1, -1, 3), np.array([1]), np.array([-1]), np.zeros((2, 3), np.int64), np.zeros((2, 3)))
    assert len(fast) == 0
    with pytest.raises(ValueError):
        FastMemory(3_000_000, 8)
    fast.refresh((-1, 2, 3), np.array([1]), np.array([-1]), ids, logits)
    assert fast.counts() == (2, 2, 1) and fast.nbytes() > 0
    with pytest.raises(ValueError):
        fast.build_tree((2, 3, 1), 4, 3, 2, 2, np.ones(2), np.ones(3))  # etas too short
    tokens, parents, depths, _ = fast.build_tree((2, 3, 1), 4, 3, 2, 2, np.ones(4), np.ones(3))
    assert len(tokens) == len(parents) == len(depths) == 4


def test_repeated_ids_in_a_loaded_row_become_one_child_in_the_engine_and_the_oracle():
    # A saved memory pads narrower rows with id 0 at probability 0: loaded back, the row repeats
    # token 0. Each child token must appear once, or the best-first search re-expands the same
    # subtree over and over (it once grew the heap until memory ran out).
    keys = np.array([5, 0], dtype=np.int64)
    ids = np.array([[7, 0, 0, 0], [9, 0, 0, 0]], dtype=np.int64)
    probs = np.array([[1.0, 0.0, 0.0, 0.0], [0.6, 0.4, 0.0, 0.0]])
    fast = FastMemory(16, 4)
    fast.load_unigram(keys, ids, probs)
    tokens, parents, depths, q = fast.build_tree((-1, -1, 5), 63, 10, 8, 4, np.full(11, 0.5), np.ones(3))
    assert len(tokens) < 63
    for parent in set(parents.tolist()):
        children = tokens[parents == parent].tolist()
        assert len(children) == len(set(children))
    reference = ReferenceSearch(RecapConfig(top_k=4, budget=63))
    reference.memory.load_unigram(keys, ids, probs)
    builder, _ = reference.build_tree([5])
    for parent in set(builder.parents):
        children = [t for t, p in zip(builder.tokens, builder.parents) if p == parent]
        assert len(children) == len(set(children))


def test_overlapping_requests_share_u_and_keep_their_own_c_and_g():
    """Request keys (`MAIN` and a fork's): U and the pool are shared, C and G are each
    request's own; ending one request forgets its C and G only, and the compaction that
    follows keeps (and remaps) the rows the other request's maps alone still point at."""
    from recap.core.fast import MAIN

    memory = FastMemory(vocab_size=64, top_k=2)
    rng = np.random.default_rng(0)

    def rows(n):
        return rng.integers(0, 64, (n, 2)), rng.normal(size=(n, 2)).astype(np.float32)

    memory.refresh((20, 21, 12), np.array([13, 24]), np.array([-1, 0]), *rows(3))
    memory.refresh((10, 11, 12), np.array([13]), np.array([-1]), *rows(2), request=1)  # U[12], U[13] rewritten
    assert memory.counts(MAIN) == (3, 3, 3) and memory.counts(1) == (3, 2, 2)
    assert set(memory.table("bigram", 1)) == {(11, 12), (12, 13)}
    assert set(memory.table("bigram")) == {(21, 12), (12, 13), (13, 24)}
    mine = {name: memory.table(name) for name in ("unigram", "bigram", "trigram")}
    memory.end_request(1)  # its rows stay U's; the stream's rows of 12 and 13 only its C and G hold
    assert memory.counts(1) == (3, 0, 0) and memory.pool_rows[0] == 5
    assert {name: memory.table(name) for name in ("unigram", "bigram", "trigram")} == mine
    tree = memory.build_tree((21, 12, 13), 8, 3, 2, 2, np.ones(4), np.array([0.7, 0.2, 0.1]))
    assert len(tree[0])  # the stream still drafts from its own C and G
    memory.reset_request(MAIN)
    assert memory.counts(MAIN) == (3, 0, 0) and memory.pool_rows[0] == 3  # what only its maps held went


def test_a_forked_request_drafts_from_its_own_c_and_g_and_teaches_the_stream_u():
    """`RecapProposer.fork_request`: the fork and the stream share one memory; the fork's
    step rows land in U at once (no replay at its end) and in C / G under its own key, so
    the stream's request neither drafts from nor holds them; the fork's end drops its C / G."""
    rng = np.random.default_rng(1)
    vocab = 40

    def prompt(ids):
        ids = np.asarray(ids, dtype=np.int64)
        return PromptRows(ids=ids, topk_ids=rng.integers(0, vocab, (len(ids), 4)),
                          topk_logits=rng.normal(size=(len(ids), 4)).astype(np.float32),
                          eligible=np.ones(len(ids), bool), vocab_size=vocab, excluded_tokens=frozenset())

    stream = RecapPaperProposer()
    stream.begin_request(prompt([1, 2, 3]))
    fork = stream.fork_request()
    fork.begin_request(prompt([4, 5, 6]))
    assert fork.memory is stream.memory and fork.request.key != stream.request.key
    history = [4, 5, 6, 7]
    tree = fork.propose(history)
    n = len(tree)
    fork.observe(VerifiedTree(tree=tree, topk_ids=rng.integers(0, vocab, (n + 1, 4)),
                              topk_logits=rng.normal(size=(n + 1, 4)).astype(np.float32),
                              argmax=np.zeros(n + 1, dtype=np.int64), accepted=[]))
    u, c, g = fork.memory_counts()
    assert c > 0 and g > 0 and stream.memory_counts() == (u, 0, 0) and (7,) in stream.memory.table("unigram")
    fork.end_request()
    assert stream.memory.counts(fork.request.key) == (u, 0, 0) and (7,) in stream.memory.table("unigram")
