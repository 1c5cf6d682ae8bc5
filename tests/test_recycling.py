"""Token Recycling and Tree Recycling: template filling, refresh rules, stream/request scope,
excluded tokens, and end-to-end losslessness (with a negative control)."""

import json

import numpy as np
import pytest

import recap
from recap.check import run_check
from recap.core import DraftTree, PromptRows, StaticTreeTemplate, VerifiedTree
from recap.errors import InputError
from recap.proposers import PROPOSERS, TokenRecyclingProposer, TreeRecyclingProposer, make_proposer
from recap.proposers.token_recycling import REFERENCE_TEMPLATE, TEMPLATE_ENV, builtin_template
from recap.verifier import acceptance
from tests.broken_verifiers import first_child_walk
from tests.conftest import load_target
from tests.helpers import assert_drafted

TEMPLATE_PATHS = builtin_template().paths()


@pytest.fixture(autouse=True)
def _default_template(monkeypatch):
    monkeypatch.delenv(TEMPLATE_ENV, raising=False)


def _prompt(ids, topk_ids, *, vocab=50, eligible=None, excluded=()):
    ids = np.asarray(ids, dtype=np.int64)
    topk_ids = np.asarray(topk_ids, dtype=np.int64)
    return PromptRows(ids=ids, topk_ids=topk_ids, topk_logits=np.zeros(topk_ids.shape, np.float32),
                      eligible=np.ones(len(ids), bool) if eligible is None else np.asarray(eligible, bool),
                      vocab_size=vocab, excluded_tokens=frozenset(excluded))


def _random_rows(rng, count, vocab, k=8):
    return np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(count)])


def _step(tree: DraftTree, rows: np.ndarray) -> VerifiedTree:
    argmax = rows[:, 0]
    return VerifiedTree(tree=tree, topk_ids=rows, topk_logits=np.zeros(rows.shape, np.float32), argmax=argmax,
                        accepted=acceptance.greedy(tree, argmax))


def _oracle(paths, table, root, excluded=frozenset()):
    """Walk each rank path through the table; drop paths through an excluded token."""
    kept = []
    for path in paths:
        token, tokens = root, []
        for rank in path:
            token = int(table[token, rank])
            tokens.append(token)
        if not excluded & set(tokens):
            kept.append(tokens)
    return kept


def _tree_paths(tree: DraftTree) -> list[list[int]]:
    return [tree.path_tokens(i) for i in range(len(tree))]


# ----------------------------------------------------------------------------- core pieces
def test_the_built_in_222_template_is_the_reference_file():
    template = builtin_template()
    assert len(template) == 80 and template.max_depth == 6
    assert [s.stop - s.start for s in template.layers] == [8, 21, 25, 15, 8, 3]
    assert make_proposer("token-recycling").template.paths() == template.paths()
    if not REFERENCE_TEMPLATE.is_file():
        pytest.skip(f"the reference file is not at {REFERENCE_TEMPLATE}")
    assert template.paths() == json.loads(REFERENCE_TEMPLATE.read_text())["paths"]
    assert StaticTreeTemplate.from_json(REFERENCE_TEMPLATE).paths() == template.paths()


def test_full_template_and_reordering_by_depth():
    full = StaticTreeTemplate.full(2, 4)
    assert len(full) == 30 and [s.stop - s.start for s in full.layers] == [2, 4, 8, 16]
    # A valid but depth-interleaved order is regrouped by depth, parents still first.
    mixed = StaticTreeTemplate.from_paths([[0], [0, 1], [1], [0, 1, 0]])
    assert mixed.paths() == [[0], [1], [0, 1], [0, 1, 0]]


@pytest.mark.parametrize("paths", [[[0, 0], [0]], [[0], [0]], [[]], [[0], [-1]]])
def test_bad_template_paths_are_input_errors(paths):
    with pytest.raises(InputError):
        StaticTreeTemplate.from_paths(paths)


# ----------------------------------------------------------------------------- Token Recycling
def test_token_recycling_fills_the_template_rank_by_rank():
    rng = np.random.default_rng(0)
    proposer = TokenRecyclingProposer()
    proposer.begin_request(_prompt([1, 2, 3], _random_rows(rng, 3, 50)))
    # A hand-filled matrix over a small vocabulary, so repeated tokens (kept) occur.
    proposer.matrix.table[:] = _random_rows(rng, 50, 50)
    tree = proposer.propose([1, 2, 3, 7])
    assert len(tree) == 80 and tree.max_depth == 6
    assert _tree_paths(tree) == _oracle(TEMPLATE_PATHS, proposer.matrix.table, root=7)
    assert len(set(tree.tokens.tolist())) < 80  # duplicates stay, as in the official static tree
    assert tree.depths.tolist() == [len(p) for p in TEMPLATE_PATHS]


def test_zero_initialised_matrix_drafts_token_zero_everywhere():
    proposer = make_proposer("token-recycling")
    proposer.begin_request(_prompt([4, 5], _random_rows(np.random.default_rng(1), 2, 50)))
    tree = proposer.propose([4, 5, 6])
    assert len(tree) == 80 and tree.max_depth == 6 and not tree.tokens.any()


def test_prefill_rows_are_never_written():
    rng = np.random.default_rng(2)
    proposer = TokenRecyclingProposer()
    proposer.begin_request(_prompt(rng.integers(1, 50, 40), _random_rows(rng, 40, 50)))
    assert not proposer.matrix.table.any()
    assert not proposer.propose([3, 9]).tokens.any()


def test_observe_writes_every_verified_position_top8():
    rng = np.random.default_rng(3)
    proposer = TokenRecyclingProposer()
    proposer.begin_request(_prompt([1, 2], _random_rows(rng, 2, 40, k=10), vocab=40))
    proposer.matrix.table[:] = _random_rows(rng, 40, 40)
    before = proposer.matrix.table.copy()
    tree = proposer.propose([1, 2, 11])
    rows = _random_rows(rng, len(tree) + 1, 40, k=10)  # wider than 8: truncated
    proposer.observe(_step(tree, rows))
    positions = [11, *tree.tokens.tolist()]
    expected = before.copy()
    for position, token in enumerate(positions):  # sequential scatter: the last position wins
        expected[token] = rows[position, :8]
    assert np.array_equal(proposer.matrix.table, expected)
    assert len(set(positions)) < len(positions)  # the duplicate rule was exercised


def test_matrix_persists_across_requests_until_reset_stream():
    rng = np.random.default_rng(4)
    proposer = TokenRecyclingProposer()
    proposer.begin_request(_prompt([1, 2], _random_rows(rng, 2, 50)))
    tree = proposer.propose([1, 2])
    proposer.observe(_step(tree, _random_rows(rng, len(tree) + 1, 50)))
    proposer.end_request()
    written = proposer.matrix.table.copy()
    assert written.any()
    proposer.begin_request(_prompt([9, 8, 7], _random_rows(rng, 3, 50)))
    assert np.array_equal(proposer.matrix.table, written)
    assert _tree_paths(proposer.propose([9, 2])) == _oracle(TEMPLATE_PATHS, written, root=2)
    proposer.reset_stream()
    assert not proposer.matrix.table.any()


def test_excluded_tokens_are_dropped_with_their_subtrees():
    rng = np.random.default_rng(5)
    excluded = {3, 17, 29}
    proposer = TokenRecyclingProposer()
    proposer.begin_request(_prompt([1, 2], _random_rows(rng, 2, 40), vocab=40, excluded=excluded))
    proposer.matrix.table[:] = _random_rows(rng, 40, 40)
    tree = proposer.propose([1, 2, 5])
    expected = _oracle(TEMPLATE_PATHS, proposer.matrix.table, root=5, excluded=excluded)
    assert 0 < len(expected) < 80  # some subtrees were dropped, not all
    assert _tree_paths(tree) == expected
    assert not excluded & set(tree.tokens.tolist())


def test_token_recycling_needs_top8_rows():
    proposer = TokenRecyclingProposer()
    with pytest.raises(InputError, match="Top-8"):
        proposer.begin_request(_prompt([1, 2], _random_rows(np.random.default_rng(6), 2, 50, k=4)))


def test_missing_template_is_an_input_error(tmp_path, monkeypatch):
    missing = tmp_path / "nope.json"
    with pytest.raises(InputError, match="nope.json"):
        TokenRecyclingProposer(template=missing)
    monkeypatch.setenv(TEMPLATE_ENV, str(missing))
    with pytest.raises(InputError, match=f"nope.json.*{TEMPLATE_ENV}"):
        make_proposer("token-recycling")
    # The env var also points at a working template (a tiny one, written here).
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"paths": [[0], [1], [0, 0]]}))
    monkeypatch.setenv(TEMPLATE_ENV, str(small))
    assert len(make_proposer("token-recycling").template) == 3


# ----------------------------------------------------------------------------- Tree Recycling
FULL_2_4 = StaticTreeTemplate.full(2, 4).paths()


def test_tree_recycling_expands_30_candidates_when_rows_are_known():
    rng = np.random.default_rng(7)
    proposer = TreeRecyclingProposer()
    proposer.begin_request(_prompt([1], _random_rows(rng, 1, 60), vocab=60))
    proposer.matrix.write(np.arange(60), _random_rows(rng, 60, 60))
    tree = proposer.propose([1, 4])
    assert len(tree) == 30 and tree.max_depth == 4 and len(tree) + 1 == 31
    assert _tree_paths(tree) == _oracle(FULL_2_4, proposer.matrix.table, root=4)


def test_tree_recycling_drops_subtrees_of_unknown_rows():
    rng = np.random.default_rng(8)
    proposer = TreeRecyclingProposer()
    proposer.begin_request(_prompt([1], _random_rows(rng, 1, 60), eligible=[False], vocab=60))
    assert len(proposer.propose([1])) == 0  # the root has no row: nothing to draft
    known = rng.choice(60, size=30, replace=False)
    proposer.matrix.write(known, _random_rows(rng, 30, 60))
    root = int(known[0])
    tree = proposer.propose([root])
    table = proposer.matrix.table
    # Oracle: a path survives while every token it expands from has a row.
    expected = []
    for path in FULL_2_4:
        token, tokens = root, []
        for rank in path:
            token = int(table[token, rank]) if token in set(known.tolist()) else -1
            tokens.append(token)
        if -1 not in tokens:
            expected.append(tokens)
    assert 2 <= len(expected) < 30 and _tree_paths(tree) == expected


def test_tree_recycling_is_seeded_from_eligible_prompt_rows_first_occurrence():
    rows = _random_rows(np.random.default_rng(9), 5, 50)
    proposer = TreeRecyclingProposer()
    proposer.begin_request(_prompt([10, 11, 10, 12, 13], rows, eligible=[1, 1, 1, 0, 1]))
    table = proposer.matrix.table
    assert np.array_equal(table[10], rows[0, :4])  # first occurrence, not the later one
    assert np.array_equal(table[11], rows[1, :4]) and np.array_equal(table[13], rows[4, :4])
    assert (table[12] == -1).all()  # not eligible: no row
    assert proposer.matrix.rows_written() == 3


def test_tree_recycling_matrix_is_request_local():
    rng = np.random.default_rng(10)
    proposer = TreeRecyclingProposer()
    proposer.begin_request(_prompt([10, 11], _random_rows(rng, 2, 50)))
    tree = proposer.propose([10, 11])
    rows = _random_rows(rng, len(tree) + 1, 50)
    proposer.observe(_step(tree, rows))
    assert proposer.matrix.rows_written() > 2
    proposer.end_request()
    proposer.begin_request(_prompt([20], _random_rows(rng, 1, 50)))
    assert proposer.matrix.rows_written() == 1 and (proposer.matrix.table[20] != -1).all()


def test_tree_recycling_refresh_keeps_the_first_occurrence_in_a_verification():
    rng = np.random.default_rng(11)
    proposer = TreeRecyclingProposer()
    # Rows of 5 and 6 lead only to 5 and 6: a full tree of repeated tokens.
    proposer.begin_request(_prompt([5, 6], [[5, 6, 7, 8, 9, 1, 2, 3], [6, 5, 7, 8, 9, 1, 2, 3]], vocab=50))
    tree = proposer.propose([5])
    assert len(tree) == 30 and set(tree.tokens.tolist()) == {5, 6}
    rows = _random_rows(rng, len(tree) + 1, 50)
    proposer.observe(_step(tree, rows))
    assert np.array_equal(proposer.matrix.table[5], rows[0, :4])  # the root's row, not a later node's
    first_six = 1 + tree.tokens.tolist().index(6)
    assert np.array_equal(proposer.matrix.table[6], rows[first_six, :4])


# ----------------------------------------------------------------------------- end to end
def _planted(cls):
    class Planted(cls):
        """The method, plus rows planted at each request from the reference run: the tiny random
        models never repeat themselves, so without them nothing would be accepted. The true next
        token sits at rank 0 or 1 among random decoys (sometimes an excluded token); everything
        else (expansion, verification, refresh) is the method's own code."""

        excluded_planted = 0
        excluded_drafted = 0

        def set_reference(self, reference):
            self.reference = list(reference)

        def propose(self, history, limits=None):
            tree = super().propose(history)
            self.excluded_drafted += bool(self.prompt.excluded_tokens & set(tree.tokens.tolist()))
            return tree

        def begin_request(self, prompt):
            super().begin_request(prompt)
            rng = np.random.default_rng(len(self.reference))
            vocab = prompt.vocab_size
            decoys = sorted(prompt.excluded_tokens)[:1]
            keys, rows = [], []
            for i in range(len(prompt.ids) - 1, len(self.reference) - 1):
                if rng.random() < 0.7:
                    row = rng.integers(0, vocab, self.top_k)
                    if decoys and rng.random() < 0.3:
                        row[0] = decoys[0]
                        self.excluded_planted += 1
                    row[int(rng.integers(2))] = self.reference[i + 1]
                    keys.append(self.reference[i])
                    rows.append(row)
            if keys:
                self.matrix.write(np.array(keys), np.array(rows), first_wins=True)

    return Planted()


def _assert_all_passed(report):
    failures = [(case.index, case.first_difference) for case in report.cases if not case.passed]
    assert not failures, f"{len(failures)} mismatches (case, first differing token): {failures}"


@pytest.mark.parametrize("method", ["token-recycling", "tree-recycling"])
def test_recycling_is_lossless_with_accepted_drafts_on_tiny_architectures(tiny_target, method):
    proposer = _planted(PROPOSERS[method])
    report = run_check(tiny_target, proposer, prompts=30, max_new_tokens=40, vary=True, seed=21)
    _assert_all_passed(report)
    assert_drafted(report, min_accepted=50)
    assert report.tau > 1.5 and max(case.tau for case in report.cases) > 2.0
    assert proposer.excluded_drafted == 0
    assert (proposer.excluded_planted > 20) == tiny_target.accepts_images  # VLMs: image tokens were offered


@pytest.mark.no_accepted_drafts(reason="unplanted, the random models give nothing to recycle: the planted test accepts")
@pytest.mark.parametrize("method", ["token-recycling", "tree-recycling"])
def test_unplanted_recycling_is_lossless_on_tiny_architectures(tiny_target, method):
    _assert_all_passed(run_check(tiny_target, method, prompts=6, max_new_tokens=24, vary=True, seed=22))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["token-recycling", "tree-recycling"])
def test_recycling_is_lossless_and_accepts_on_smollm2(smollm2, method):
    report = run_check(smollm2, method, prompts=5, max_new_tokens=32, seed=23)
    _assert_all_passed(report)
    assert_drafted(report, min_accepted=10)
    assert report.tau > 1.2  # a real model's recycled predictions are accepted


def test_accepting_the_first_child_is_detected_with_recycling(tiny_llama, monkeypatch):
    """The same check catches a verifier that walks into the first child whatever the argmax."""
    monkeypatch.setattr(acceptance, "greedy", first_child_walk)
    report = run_check(tiny_llama, _planted(TokenRecyclingProposer), prompts=6, max_new_tokens=24, seed=24)
    assert report.failed > 0


def test_both_methods_are_registered():
    assert isinstance(make_proposer("token-recycling"), TokenRecyclingProposer)
    assert isinstance(make_proposer("tree-recycling"), TreeRecyclingProposer)


def test_token_recycling_stream_saves_and_loads(tmp_path):
    """The bench checkpoints Token Recycling's matrix after each unit; a reload continues it."""
    proposer = TokenRecyclingProposer()
    with pytest.raises(InputError, match="nothing to save"):
        proposer.save_memory(tmp_path / "empty.safetensors")
    target = load_target("tiny-llama")
    recap.generate(target, "Fill the matrix, please.", method=proposer, max_new_tokens=10)
    path = tmp_path / "tr.safetensors"
    proposer.save_memory(path)
    loaded = TokenRecyclingProposer()
    loaded.load_memory(path)
    assert proposer.matrix.rows_written() > 5
    assert np.array_equal(loaded.matrix.table, proposer.matrix.table)
    history = [int(t) for t in target.prepare("Another prompt").prompt_ids]
    rows, _ = target.prefill(target.prepare("Another prompt"))
    target.release()
    for p in (proposer, loaded):
        p.begin_request(rows)
    assert np.array_equal(loaded.propose(history).tokens, proposer.propose(history).tokens)
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(InputError):
        TokenRecyclingProposer().load_memory(path)
