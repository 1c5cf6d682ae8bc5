"""RECAP: recycle the target's own Top-K predictions as drafts.

propose: best-first tree over fused memory rows + a suffix-automaton continuation.
observe: every evaluated node's row refreshes U, C and G; committed tokens extend the automaton.

One proposer object is one *stream*: U (token-keyed memory) persists across its requests,
C/G and the automaton are per request. ``reset_stream()`` starts a new stream.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace
from os import PathLike

import numpy as np

from recap.core import ROOT, DraftTree, PromptRows, TreeBuilder, VerifiedTree
from recap.core.fast import FastMemory, context_of
from recap.core.fusion import FUSION_MODES, PRIORS, fuse
from recap.core.memory import PredictionMemory
from recap.core.suffix import SuffixAutomaton
from recap.errors import InputError
from recap.proposers.base import BaseProposer

ENGINES = ("numba", "python")


@dataclass(frozen=True)
class RecapConfig:
    """Paper defaults. ``budget`` counts tree candidates (root excluded); the suffix
    continuation may add up to ``suffix_tokens`` more nodes."""

    top_k: int = 8
    width: int = 8
    max_depth: int = 10
    budget: int = 63
    depth_priors: tuple[float, ...] = (0.68, 0.63, 0.50, 0.43, 0.40, 0.38)
    tail_depth_prior: float = 0.38
    priors: tuple[float, ...] = PRIORS
    fusion: str = "entropy"
    suffix_tokens: int = 4
    persistent_unigram: bool = True
    persistent_context: bool = False
    """Keep C/G across requests too (an ablation: their rows then alias across images)."""
    engine: str = "numba"
    """``numba``: memory, fusion and tree search compiled (`recap.core.fast`); ``python``: the
    readable reference implementation (same trees, differentially tested)."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise InputError(f"unknown engine {self.engine!r}; choose one of: {', '.join(ENGINES)}")
        if self.fusion not in FUSION_MODES:
            raise InputError(f"unknown fusion mode {self.fusion!r}; choose one of: {', '.join(FUSION_MODES)}")
        for name in ("top_k", "width", "max_depth"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be at least 1")
        if self.budget < 0 or self.suffix_tokens < 0:
            raise InputError("budget and suffix_tokens cannot be negative")

    def depth_prior(self, depth: int) -> float:
        return self.depth_priors[depth - 1] if depth <= len(self.depth_priors) else self.tail_depth_prior


ABLATIONS: dict[str, dict] = {
    "no-confidence": {"fusion": "no-confidence"},
    "no-prior": {"fusion": "no-prior"},
    "uniform": {"fusion": "uniform"},
    "gate": {"fusion": "gate"},
    "backoff": {"fusion": "backoff"},
    "unigram": {"fusion": "unigram"},
    "reset-U": {"persistent_unigram": False},
    "no-suffix": {"suffix_tokens": 0},
    "persistent-CG": {"persistent_context": True},
}
"""Named ablation switches (one ingredient changed each)."""


class RecapProposer(BaseProposer):
    name = "recap"
    stream_state = True

    def __init__(self, config: RecapConfig | None = None, *, ablation: str | None = None,
                 memory_file: str | PathLike | None = None, **overrides):
        config = config or RecapConfig()
        if ablation:
            if ablation not in ABLATIONS:
                raise InputError(f"unknown ablation {ablation!r}; choose one of: {', '.join(ABLATIONS)}")
            config = replace(config, **ABLATIONS[ablation])
        self.config = replace(config, **overrides) if overrides else config
        self.memory: PredictionMemory | FastMemory | None = PredictionMemory() if self.config.engine == "python" \
            else None  # the compiled memory needs the vocabulary size: made at the first request
        self.automaton = SuffixAutomaton()
        self.vocab_size: int | None = None
        self._excluded: frozenset[int] = frozenset()
        self._excluded_mask: np.ndarray | None = None
        self._context: list[int] = []
        self._pending_memory = None
        self._fusion_cache: dict[tuple, tuple] = {}
        self._etas = [0.0] + [self.config.depth_prior(d) for d in range(1, self.config.max_depth + 1)]
        self._eta_array = np.array(self._etas, dtype=np.float64)
        self._prior_array = np.array(self.config.priors, dtype=np.float64)
        if memory_file is not None:
            self.load_memory(memory_file)

    # ------------------------------------------------------------------ stream / request
    def reset_stream(self) -> None:
        """Forget everything, U included: a new stream starts."""
        if self.memory is not None:
            self.memory.reset_stream()

    def begin_request(self, prompt: PromptRows) -> None:
        self.prompt = prompt
        if self.config.engine == "numba" and (self.memory is None or self.vocab_size != prompt.vocab_size):
            self.memory = FastMemory(prompt.vocab_size, self.config.top_k)  # another vocabulary: a new stream
        self.vocab_size = prompt.vocab_size
        if self._pending_memory is not None:
            self._pending_memory.install(self.memory, prompt.vocab_size)
            self._pending_memory = None
        if not self.config.persistent_unigram:
            self.memory.reset_stream()
        elif not self.config.persistent_context:
            self.memory.reset_request()
        if isinstance(self.memory, FastMemory):
            self.memory.seed_from_prompt(prompt.ids, prompt.topk_ids, prompt.topk_logits, prompt.eligible)
        else:
            self.memory.seed_from_prompt(prompt)
        if prompt.excluded_tokens != self._excluded or self._excluded_mask is None:
            self._excluded = prompt.excluded_tokens
            self._excluded_mask = None
            if self._excluded:
                self._excluded_mask = np.zeros(prompt.vocab_size, dtype=bool)
                self._excluded_mask[[t for t in self._excluded if 0 <= t < prompt.vocab_size]] = True
        self.automaton = SuffixAutomaton(prompt.ids.tolist()) if self.config.suffix_tokens else SuffixAutomaton()

    def end_request(self) -> None:
        if not self.config.persistent_context:
            self.memory.reset_request()

    def memory_counts(self) -> tuple[int, int, int]:
        """Rows held by (U, C, G)."""
        if self.memory is None:
            return 0, 0, 0
        if isinstance(self.memory, FastMemory):
            return self.memory.counts()
        return len(self.memory.unigram), len(self.memory.bigram), len(self.memory.trigram)

    # ------------------------------------------------------------------ drafting
    def propose(self, history: Sequence[int]) -> DraftTree:
        self.sync_automaton(history)
        self._context = list(history[-3:])
        tokens, parents, depths = self.search(self._context)
        self.add_suffix(tokens, parents, depths)
        return DraftTree._trusted(tokens, parents, depths)

    def sync_automaton(self, history: Sequence[int]) -> None:
        """Feed the automaton the committed tokens it has not seen (the first is the prefill's)."""
        if self.config.suffix_tokens:
            self.automaton.sync(history)

    def search(self, context: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """Lookup + fusion + best-first search: (tokens, parents, depths) of the tree."""
        config = self.config
        if isinstance(self.memory, FastMemory):
            tokens, parents, depths = self.memory.build_tree(
                context_of(context), config.budget, config.max_depth, config.width, config.top_k, self._eta_array,
                self._prior_array, config.fusion, self._excluded_mask)
            return tokens.tolist(), parents.tolist(), depths.tolist()
        builder = self.build_tree(context)
        return builder.tokens, builder.parents, builder.depths

    def add_suffix(self, tokens: list[int], parents: list[int], depths: list[int]) -> None:
        """Insert the automaton's continuation along a root path, reusing existing nodes;
        fused scores are untouched (the new nodes only extend the tree)."""
        if not self.config.suffix_tokens:
            return
        continuation = []
        for token in self.automaton.continuation(self.config.suffix_tokens):
            if token in self._excluded:
                break
            continuation.append(token)
        if not continuation:
            return
        index = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens))}
        parent = ROOT
        for token in continuation:
            node = index.get((parent, token))
            if node is None:
                node = len(tokens)
                tokens.append(token)
                parents.append(parent)
                depths.append(1 if parent == ROOT else depths[parent] + 1)
                index[(parent, token)] = node
            parent = node

    def fused(self, u: int | None, v: int | None, x: int) -> tuple[Sequence[int], Sequence[float]]:
        """q(. | ..., u, v, x): retrieval and fusion for one path context, image tokens removed,
        at most ``width`` children. Memoised per context within one `build_tree` call (the
        memory does not change during a proposal)."""
        key = (u, v, x)
        cached = self._fusion_cache.get(key)
        if cached is not None:
            return cached
        memory = self.memory
        if self.config.fusion == "unigram":
            row = memory.unigram.get(x)
            rows = [row] if row is not None else []
        else:
            rows = memory.lookup(u, v, x)
        config = self.config
        tokens, probs = fuse(rows, config.top_k, config.fusion, config.priors)
        if self._excluded and not self._excluded.isdisjoint(tokens):
            kept = [(t, p) for t, p in zip(tokens, probs) if t not in self._excluded]
            tokens, probs = [t for t, _ in kept], [p for _, p in kept]
        if len(tokens) > config.width:
            tokens, probs = tokens[: config.width], probs[: config.width]
        self._fusion_cache[key] = (tokens, probs)
        return tokens, probs

    def build_tree(self, context: Sequence[int]) -> TreeBuilder:
        """Best-first expansion by path score prod_j eta_j q(z_j | h_j).

        Children of a node are sorted by q, so the heap only ever holds, per expanded node,
        its best not-yet-added child: popping a child pushes its next sibling and its own
        first child. Children of one parent are distinct, so no duplicate check is needed.
        """
        config = self.config
        etas = self._etas
        self._fusion_cache.clear()
        padded = [None, None, *context][-3:]
        root_context = (padded[0], padded[1], padded[2])
        fused = self.fused
        builder = TreeBuilder()
        add = builder.add
        heap: list[tuple[float, int, int, tuple, int, float, int, Sequence[int], Sequence[float]]] = []
        push, pop = heapq.heappush, heapq.heappop
        tokens, probs = fused(*root_context)
        if tokens:
            heap.append((-etas[1] * probs[0], 0, ROOT, root_context, 0, 1.0, 1, tokens, probs))
        counter = 0
        budget, max_depth = config.budget, config.max_depth
        while heap and len(builder.tokens) < budget:
            negative, _, parent, parent_context, index, parent_score, depth, tokens, probs = pop(heap)
            token = tokens[index]
            node = add(parent, token)
            counter += 1
            if index + 1 < len(tokens):
                sibling = parent_score * etas[depth] * probs[index + 1]
                push(heap, (-sibling, counter, parent, parent_context, index + 1, parent_score, depth, tokens, probs))
            if depth < max_depth:
                child_context = (parent_context[1], parent_context[2], token)
                child_tokens, child_probs = fused(*child_context)
                if child_tokens:
                    counter += 1
                    score = -negative
                    push(heap, (-score * etas[depth + 1] * child_probs[0], counter, node, child_context, 0, score,
                                depth + 1, child_tokens, child_probs))
        return builder

    # ------------------------------------------------------------------ learning
    def observe(self, step: VerifiedTree) -> None:
        self.refresh(step)
        if self.config.suffix_tokens:
            for token in step.committed:
                self.automaton.extend(token)

    def refresh(self, step: VerifiedTree) -> None:
        """Every evaluated node's row into U, C and G under its own path context."""
        contextual = self.config.fusion != "unigram"
        if isinstance(self.memory, FastMemory):
            self.memory.refresh(context_of(self._context), step.tree.tokens, step.tree.parents, step.topk_ids,
                                step.topk_logits, contextual)
        else:
            self.memory.refresh(self._context, step, contextual=contextual)

    # ------------------------------------------------------------------ persistence
    def save_memory(self, path: str | PathLike) -> None:
        """Write U (the stream's token memory) to ``path`` (see `recap.core.persistence`)."""
        from recap.core.persistence import save_token_memory

        if self.vocab_size is None or self.memory is None:
            raise InputError("nothing to save yet: the memory's vocabulary is known after the first request")
        save_token_memory(path, *self.memory.unigram_arrays(), vocab_size=self.vocab_size)

    def load_memory(self, path: str | PathLike) -> None:
        """Read a U file now (errors surface here); it is installed at the next request,
        once the target's vocabulary is known and checked."""
        from recap.core.persistence import read_token_memory

        self._pending_memory = read_token_memory(path)
