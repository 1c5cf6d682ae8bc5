"""Lookahead baseline: the n-gram trie (insertion, counts, retrieval, budget) and the proposer
end to end (losslessness on every tiny architecture, then SmolLM2)."""


import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recap.check import run_check
from recap.core import DraftTree, PromptRows, VerifiedTree
from recap.core.trie import NGramTrie
from recap.proposers import LookaheadProposer, make_proposer
from tests.helpers import assert_drafted

A, B, C, D = 1, 2, 3, 4
IMAGE = 999


def _prompt(ids, excluded=()):
    ids = np.asarray(ids, dtype=np.int64)
    n = len(ids)
    return PromptRows(ids=ids, topk_ids=np.zeros((n, 1), np.int64), topk_logits=np.zeros((n, 1), np.float32),
                      eligible=np.ones(n, bool), vocab_size=1000, excluded_tokens=frozenset(excluded))


def _step(tokens):
    """A verification that accepted ``tokens[:-1]`` as a chain and produced ``tokens[-1]`` as bonus."""
    tree = DraftTree(tokens[:-1], list(range(-1, len(tokens) - 2)))
    n = len(tokens)
    return VerifiedTree(tree=tree, topk_ids=np.zeros((n, 1), np.int64), topk_logits=np.zeros((n, 1), np.float32),
                        argmax=np.asarray(tokens, np.int64), accepted=list(range(n - 1)))


def _paths(tree):
    return [tree.path_tokens(i) for i in range(len(tree))]


def _count(text, ngram):
    m = len(ngram)
    return sum(text[i : i + m] == ngram for i in range(len(text) - m + 1))


def _contains(texts, ngram):
    return any(_count(text, ngram) for text in texts)


# ----------------------------------------------------------------------------- retrieval rules
def test_multi_branch_tree_respects_budget_depth_and_frequency():
    # After the context (A, B): 10 continuations of 14 tokens, continuation j seen j + 1 times.
    rng = np.random.default_rng(0)
    text = []
    for j in range(10):
        branch = [100 + 20 * j + i for i in range(14)]
        for _ in range(j + 1):
            text += [A, B] + branch + [int(rng.integers(500, 900))]
    trie = NGramTrie()
    trie.begin_request(text)
    k, tree = trie.retrieve([7, A, B], budget=63)
    assert k == 2
    assert len(tree) == 63 and tree.max_depth <= 12
    roots = [int(t) for t, p in zip(tree.tokens, tree.parents) if p == -1]
    assert len(roots) > 1
    # Siblings come most frequent first; counts recomputed from the text, not read from the trie.
    score = {i: _count(text, [A, B] + tree.path_tokens(i)) for i in range(len(tree))}
    for parent in set(tree.parents.tolist()):
        siblings = [score[i] for i in range(len(tree)) if tree.parents[i] == parent]
        assert siblings == sorted(siblings, reverse=True)
    # Best-first: no left-out continuation (a child of a kept node, or of the root) is more
    # frequent than the least frequent kept node.
    kept = {tuple(tree.path_tokens(i)) for i in range(len(tree))}
    frontier = [()] + [p for p in kept if len(p) < 12]
    left_out = 0
    for path in frontier:
        for j in range(len(text) - len(path) - 2):
            if text[j : j + 2 + len(path)] == [A, B, *path]:
                child = (*path, text[j + 2 + len(path)])
                if child not in kept:
                    left_out = max(left_out, _count(text, [A, B, *child]))
    assert 0 < left_out <= min(score.values())
    # The most frequent continuation is drafted in full (12 deep).
    assert tree.path_tokens(int(np.argmax(tree.depths)))[:12] == [100 + 20 * 9 + i for i in range(12)]


def test_longest_context_is_preferred_and_shorter_is_the_fallback():
    x_branch = list(range(200, 215))
    y_branch = list(range(300, 315))
    text = [A, B, *x_branch] + [C, B, *y_branch] * 3 + [D]
    trie = NGramTrie()
    trie.begin_request(text)
    k, tree = trie.retrieve([9, A, B])
    assert k == 2
    assert _paths(tree)[0][0] == 200 and 300 not in tree.tokens.tolist()
    # (D, B) never occurred: fall back to B alone, where the more frequent Y comes first.
    k, tree = trie.retrieve([9, D, B])
    assert k == 1
    assert int(tree.tokens[0]) == 300 and 200 in tree.tokens.tolist()
    assert len(tree) <= 63 and tree.max_depth <= 12


def test_short_longer_match_gives_way_to_a_larger_shorter_one():
    # (A, B) is followed by 2 tokens only (then an excluded token); B alone by a long continuation.
    text = [A, B, 50, 51, IMAGE, C, B, *range(300, 320)]
    trie = NGramTrie()
    trie.begin_request(text, excluded={IMAGE})
    k, tree = trie.retrieve([A, B])
    assert k == 1 and len(tree) == 14 and {50, 300} <= set(tree.tokens.tolist())
    assert trie.retrieve([C, B])[0] == 2


def test_output_tokens_are_visible_to_the_next_propose():
    proposer = LookaheadProposer()
    proposer.begin_request(_prompt([60, 61, 62]))
    history = [60, 61, 62, 70]  # the prefill's first token
    assert len(proposer.propose(history)) == 0
    pattern = list(range(10, 30))
    for chunk in (pattern[:5], pattern[5:12], pattern[12:]):
        proposer.observe(_step(chunk))
        history += chunk
        proposer.propose(history)
    # Every window of 13 tokens after a key is complete for keys up to pattern[6]:
    proposer.observe(_step([10, 11]))
    history += [10, 11]
    tree = proposer.propose(history)
    assert tree.path_tokens(len(tree) - 1) == pattern[2:14]
    # Windows still incomplete (key pattern[10]) are not in the trie yet ...
    assert len(proposer.trie.draft([pattern[10], pattern[11]])) == 0
    # ... and enter it, shortened, when the request ends.
    proposer.end_request()
    assert proposer.trie.draft([pattern[10], pattern[11]]).tokens.tolist() == pattern[12:] + [10, 11]


def test_stream_keeps_outputs_forgets_prompts_and_resets():
    proposer = make_proposer("lookahead")
    assert isinstance(proposer, LookaheadProposer)
    prompt = list(range(40, 60))
    proposer.begin_request(_prompt(prompt))
    answer = [80, 81, 82, 83, 84, 85]
    proposer.propose(prompt + answer[:1])
    proposer.observe(_step(answer[1:]))
    assert proposer.trie.draft([40, 41]).tokens.tolist() == list(range(42, 54))
    assert proposer.trie.draft([58, 59]).tokens.tolist() == []  # output windows still incomplete
    proposer.end_request()
    # Next request: the old prompt's own n-grams are gone; the output, with the prompt tail it
    # followed, stays (output counts only).
    proposer.begin_request(_prompt([7, 8]))
    assert len(proposer.trie.draft([40, 41])) == 0
    assert proposer.propose([7, 8, 58, 59]).tokens.tolist() == answer
    proposer.end_request()
    assert all(fi == 0 and fo > 0 for _, fi, fo in proposer.trie.nodes())
    proposer.reset_stream()
    proposer.begin_request(_prompt([7, 8]))
    assert len(proposer.propose([7, 8, 58, 59])) == 0


def test_prompt_ngrams_rank_before_output_ngrams_but_keep_half_the_budget():
    trie = NGramTrie()
    # Stream output: after (A, B), 40 continuations seen twice each.
    for j in range(40):
        trie.begin_request([])
        trie.extend_output([A, B, 100 + j, 500 + j] * 2)
        trie.end_request()
    # Prompt: after (A, B), 40 other continuations seen once each.
    prompt = []
    for j in range(40):
        prompt += [A, B, 200 + j, 600 + j, 9]
    trie.begin_request(prompt)
    tree = trie.draft([A, B], budget=63)
    firsts = [int(t) for t, p in zip(tree.tokens, tree.parents) if p == -1]
    assert firsts[0] >= 200  # the prompt's own n-grams first
    from_output = sum(100 <= t < 140 for t in firsts)
    assert from_output >= 16 and sum(200 <= t < 240 for t in firsts) >= 16
    assert len(tree) == 63


def test_overgrown_keys_are_squeezed_at_the_end_of_a_request():
    trie = NGramTrie(max_key_nodes=40)
    trie.begin_request([])
    singletons = [t for j in range(30) for t in (A, 100 + j, 200 + j)]
    trie.extend_output([A, B, C, D] * 6 + singletons + [A, 300])
    trie.extend_output([A, 300])
    assert trie.counts([A, B])[1] == 6.0 and trie.counts([A, 100]) is not None
    size = len(trie)
    trie.end_request()
    # Under the overgrown key A: counts above 1 halved, n-grams seen once dropped ...
    assert trie.counts([A, B]) == (0, 3.0) and trie.counts([A, 300]) == (0, 1.0)
    assert trie.counts([A, 100]) is None and trie.counts([A, 300, A]) is None
    assert len(trie) < size
    assert trie.draft([9, A]).tokens.tolist()[:3] == [B, C, D]
    # ... other keys are left alone.
    assert trie.counts([100, 200]) == (0, 1.0)


def test_excluded_tokens_are_never_drafted():
    prompt = [A, B, IMAGE, IMAGE, C, A, B, IMAGE, D, A, B, 5, 6]
    proposer = LookaheadProposer()
    proposer.begin_request(_prompt(prompt, excluded={IMAGE}))
    history = prompt + [A]
    for tree in (proposer.propose(history), proposer.trie.draft([IMAGE]), proposer.trie.draft([A, B]),
                 proposer.trie.draft([B])):
        assert IMAGE not in tree.tokens.tolist()
    # Even an excluded token the model itself produced never comes back as a draft.
    proposer.observe(_step([B, IMAGE, C, A, B, IMAGE, C, A, B]))
    proposer.end_request()
    proposer.begin_request(_prompt([A], excluded={IMAGE}))
    for context in ([A, B], [B], [IMAGE], [C, A]):
        assert IMAGE not in proposer.trie.draft(context).tokens.tolist()


# ----------------------------------------------------------------------------- property test
def _runs(tokens, excluded):
    runs = [[]]
    for t in tokens:
        if t in excluded:
            runs.append([])
        else:
            runs[-1].append(int(t))
    return [run for run in runs if run]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), branch=st.integers(1, 6), prefix=st.integers(1, 3), budget=st.integers(1, 40))
def test_every_drafted_path_was_seen_after_its_context(data, branch, prefix, budget):
    tokens = st.integers(0, 5)
    excluded = frozenset({5})
    trie = NGramTrie(branch_length=branch, max_prefix=prefix, max_key_nodes=30)
    seen = []  # token runs of earlier requests (prompt + output)
    for _ in range(data.draw(st.integers(1, 3))):
        prompt = data.draw(st.lists(tokens, max_size=30))
        trie.begin_request(prompt, excluded)
        # Prompt counts are exact n-gram counts (n-grams never span an excluded token).
        runs = _runs(prompt, excluded)
        for run in runs:
            for m in range(2, min(len(run), trie.window + 1) + 1):
                for i in range(len(run) - m + 1):
                    gram = run[i : i + m]
                    counts = trie.counts(gram)
                    assert counts is not None and counts[0] == sum(_count(r, gram) for r in runs)
        history = list(prompt) + [data.draw(tokens)]
        trie.extend_output(history[-1:])
        for chunk in data.draw(st.lists(st.lists(tokens, min_size=1, max_size=12), max_size=8)):
            k, tree = trie.retrieve(history, budget)
            assert len(tree) <= budget and tree.max_depth <= branch
            assert not set(tree.tokens.tolist()) & excluded
            if len(tree):
                assert 1 <= k <= prefix
                texts = seen + _runs(history, excluded)
                for path in _paths(tree):
                    assert _contains(texts, history[len(history) - k :] + path)
            trie.extend_output(chunk)
            history += chunk
        trie.end_request()
        seen += _runs(history, excluded)
        # Between requests only output counts remain, in windows of key + window tokens.
        for depth, fi, fo in trie.nodes():
            assert fi == 0 and fo > 0 and depth <= trie.window + 1


# ----------------------------------------------------------------------------- host cost
def test_a_long_text_like_stream_keeps_trees_within_the_budget():
    """Host cost is measured by `recap overhead --method lookahead` (a benchmark), not here."""
    rng = np.random.default_rng(0)
    vocab = 2000
    # A synthetic stream with text-like repetition: Zipf tokens plus copied spans.
    def text(n):
        out = list(rng.zipf(1.3, n) % vocab)
        for _ in range(n // 40):
            i, j = rng.integers(0, n - 20, 2)
            out[j : j + 15] = out[i : i + 15]
        return [int(t) for t in out[:n]]

    proposer = LookaheadProposer()
    sizes = []
    for _ in range(6):
        prompt = text(400)
        proposer.begin_request(_prompt(prompt))
        history = prompt + [prompt[5]]
        answer = text(200)
        pos = 0
        while pos < len(answer):
            step = answer[pos : pos + int(rng.integers(1, 5))]  # accepted tokens + a bonus token
            verified = _step(step)
            tree = proposer.propose(history)
            proposer.observe(verified)
            sizes.append(len(tree))
            assert len(tree) <= 63
            history += step
            pos += len(step)
        proposer.end_request()
    assert max(sizes) > 0  # the copied spans were found and drafted


# ----------------------------------------------------------------------------- end to end
def _assert_all_passed(report):
    failures = [(case.index, case.first_difference) for case in report.cases if not case.passed]
    assert not failures, f"{len(failures)} mismatches (case, first differing token): {failures}"


def test_lookahead_is_lossless_on_tiny_architectures(tiny_target):
    proposer = LookaheadProposer()
    _assert_all_passed(run_check(tiny_target, proposer, prompts=30, max_new_tokens=40, vary=True, seed=21))
    # Random-weight models rarely repeat themselves, so the first pass drafts little. The same
    # stream replaying its first prompts (other limits and stop tokens) drafts from the
    # persistent output n-grams: deep multi-token acceptance, cuts inside accepted paths.
    replay = run_check(tiny_target, proposer, prompts=10, max_new_tokens=40, vary=True, seed=22)
    _assert_all_passed(replay)
    assert_drafted(replay, min_accepted=50)
    assert replay.tau > 2.0
    assert any(case.cut_inside_path for case in replay.cases)


@pytest.mark.slow
def test_lookahead_is_lossless_on_smollm2(smollm2):
    report = run_check(smollm2, "lookahead", prompts=5, max_new_tokens=32, seed=22)
    _assert_all_passed(report)
    assert_drafted(report)
