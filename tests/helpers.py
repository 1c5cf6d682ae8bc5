"""Assertions shared by the tests.

`assert_drafted`: a losslessness test whose drafts were never accepted proves nothing about
the tree walk (an empty tree, or one the verifier rejects whole, is lossless by construction),
so every test that claims losslessness *with drafting* also asserts, in one line, that the
target accepted drafted tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from recap.check import CheckCase, CheckReport
from recap.core import DraftTree
from recap.decoding import GenerationResult


def accepted_drafts(evidence: Any) -> int:
    """Draft tokens the target accepted, read from what a test has at hand: a
    `GenerationResult`, a `CheckReport` or `CheckCase`, a `recap.hf.custom_generate` callable
    (its latest call), a served answer's ``recap`` block (a dict, the whole JSON body, or an
    ``openai`` response / stream chunk carrying it), or a list of any of these (summed)."""
    if isinstance(evidence, GenerationResult):
        return sum(it.accepted for it in evidence.iterations)
    if isinstance(evidence, (CheckReport, CheckCase)):
        return evidence.accepted
    if hasattr(evidence, "last") and hasattr(evidence, "proposer"):  # recap.hf.RecapGenerate
        if evidence.last is None:
            raise AssertionError("the custom_generate callable has not generated anything yet")
        return accepted_drafts(evidence.last)
    extra = getattr(evidence, "model_extra", None)  # openai's ChatCompletion / ChatCompletionChunk
    if isinstance(extra, Mapping):
        if "recap" not in extra:
            raise AssertionError(f"the answer carries no 'recap' block: {sorted(extra)}")
        return accepted_drafts(extra["recap"])
    if isinstance(evidence, Mapping):
        block = evidence.get("recap", evidence)
        if "accepted_tokens" not in block:
            raise AssertionError(f"no 'accepted_tokens' in {block!r}")
        return int(block["accepted_tokens"])
    if isinstance(evidence, Iterable) and not isinstance(evidence, (str, bytes)):
        return sum(accepted_drafts(item) for item in evidence)
    raise TypeError(f"cannot read accepted drafts from a {type(evidence).__name__}")


assert_drafted_calls = 0
"""Calls so far (tests/conftest.py checks that each losslessness test made one)."""


def assert_drafted(evidence: Any, min_accepted: int = 1) -> int:
    """Assert that at least ``min_accepted`` drafted tokens were accepted; returns the count."""
    global assert_drafted_calls
    assert_drafted_calls += 1
    if min_accepted < 1:
        raise ValueError("min_accepted must be at least 1: asserting nothing is not a check")
    accepted = accepted_drafts(evidence)
    assert accepted >= min_accepted, (f"{accepted} drafted tokens accepted, expected at least {min_accepted}: "
                                      "the output's equality never exercised an accepted draft path")
    return accepted


class ReferencePrimed:
    """Mixin for a drafter that looks up its drafts in the context (``propose(history)``): on
    every other request it drafts from prompt + reference output + history, so the real
    method's code finds the true continuation and drafts get accepted. The tiny random
    models never repeat themselves, so without this such a drafter's losslessness check would
    never see an accepted draft. `recap.check.run_check` calls ``set_reference``."""

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.requests = 0
        self._reference: list[int] = []
        self._prefix: list[int] = []

    def set_reference(self, ids: list[int]) -> None:
        self._reference = list(ids)

    def begin_request(self, prompt):
        super().begin_request(prompt)
        self.requests += 1
        self._prefix = self._reference if self.requests % 2 == 0 else []

    def propose(self, history, limits=None):
        return super().propose(self._prefix + list(history))


def step_logits(decoder: Any, tree_size: int = 12) -> list[np.ndarray]:
    """A 7-token prompt on a `FastDecoder`, then a verify of a random tree after it: each one's
    logits (copies), for bit-for-bit comparisons of two decoders."""
    rng = np.random.default_rng(0)
    cache = decoder.new_cache(64)
    logits = []
    prompt = np.arange(7, dtype=np.int64) + 100  # a chain: row i sees rows 0..i
    chain_starts = np.cumsum([0] + [i + 1 for i in range(7)]).astype(np.int64)
    chain_paths = np.concatenate([np.arange(i + 1) for i in range(7)]).astype(np.int64)
    logits.append(decoder.forward(cache, prompt, np.arange(7, dtype=np.int64), chain_starts, chain_paths).copy())
    cache.commit(list(range(7)))
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, tree_size)]
    tree = DraftTree(rng.integers(0, min(1000, decoder.args.vocab), tree_size), parents)
    starts, paths = tree.ancestor_lists()
    tokens, _ = tree.packed(42)
    depth = np.diff(starts) - 1
    logits.append(decoder.forward(cache, np.asarray(tokens, np.int64), (7 + depth).astype(np.int64),
                                  np.asarray(starts, np.int64),
                                  np.asarray(paths, np.int64)).copy())
    return logits
