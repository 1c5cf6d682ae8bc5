"""RECAP: recycle the target's own Top-K predictions as drafts.

propose: best-first tree over fused memory rows + suffix-automaton continuations.
observe: every evaluated node's row refreshes U, C and G; committed tokens extend the automaton.

Two configurations share this code:

- ``recap-paper`` (`PAPER`): the paper's exact method: 63 best-first candidates plus a
  4-token continuation of the request's suffix match, the same tree every step.
- ``recap`` (the default, cost-aware): every candidate node gets an estimate of the
  probability that it is accepted once its parent is (`recap.core.calibration`, learned
  online within the stream). Candidates are the recycled tree, the request's suffix
  continuation (growing with the match length, up to 40 tokens) and a continuation from the
  stream's earlier outputs (`recap.core.store`), merged into one tree. Ordered by the
  probability that their whole path is accepted, every prefix is a valid tree; the step
  drafts the prefix that maximises (1 + expected accepted tokens) / predicted verify time
  (`recap.core.chooser`, with the caller's `StepLimits.cost`), N = 0 included.

One proposer object is one *stream*: U (token-keyed memory), the calibrator and the output
store persist across its requests; C/G and the automaton are per request.
``reset_stream()`` starts a new stream.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace
from os import PathLike

import numpy as np

from recap.core import ROOT, DraftTree, PromptRows, StepLimits, TreeBuilder, VerifiedTree
from recap.core.calibration import REQUEST, STORE, AcceptanceCalibrator, continuation_cells, recycled_cells
from recap.core.chooser import Candidates, ChosenTree, choose
from recap.core.fast import FastMemory, context_of
from recap.core.fusion import FUSION_MODES, PRIORS, fuse
from recap.core.memory import PredictionMemory
from recap.core.store import OutputStore
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
    """``numba``: memory, fusion and tree search compiled (`recap.core.fast`), what users run;
    ``python``: the readable reference kept as the oracle of the tests (same trees)."""
    cost_aware: bool = True
    """Choose each step's tree size from the verify-cost profile; False: always draft
    ``budget`` candidates (plus the continuation), as the paper does."""
    calibration: bool = True
    """Learn acceptance probabilities online; False: keep the conservative priors."""
    long_continuation: bool = True
    """Continuations of clamp(4 x match length, 2, ``max_continuation``) tokens; False:
    ``suffix_tokens``."""
    max_continuation: int = 40
    stream_store: bool = True
    """Also draft continuations from the stream's earlier outputs."""
    store_tokens: int = 16384
    """Bound of the output store (tokens, per stream)."""
    max_memory_rows: int | None = None
    """Bound of U (rows, per stream; None: one per vocabulary token at most). Past it, after a
    request, the rows whose token was least recently in a request's text are evicted."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise InputError(f"unknown engine {self.engine!r}; choose one of: {', '.join(ENGINES)}")
        if self.fusion not in FUSION_MODES:
            raise InputError(f"unknown fusion mode {self.fusion!r}; choose one of: {', '.join(FUSION_MODES)}")
        for name in ("top_k", "width", "max_depth"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be at least 1")
        if self.budget < 0 or self.suffix_tokens < 0 or self.max_continuation < 0:
            raise InputError("budget, suffix_tokens and max_continuation cannot be negative")
        if self.store_tokens < 2:
            raise InputError("store_tokens must be at least 2")
        if self.max_memory_rows is not None and self.max_memory_rows < 1:
            raise InputError("max_memory_rows must be at least 1")

    @property
    def scored(self) -> bool:
        """Whether drafts carry acceptance estimates (anything beyond the paper's tree)."""
        return self.cost_aware or self.long_continuation or self.stream_store

    def continuation_length(self, match_length: int) -> int:
        if not self.long_continuation:
            return self.suffix_tokens if self.suffix_tokens else 0
        return max(2, min(self.max_continuation, 4 * match_length))

    def depth_prior(self, depth: int) -> float:
        return self.depth_priors[depth - 1] if depth <= len(self.depth_priors) else self.tail_depth_prior


REQUEST_PSEUDO = 4.0
"""Pseudo-count of the request-level correction: within a request every estimate is scaled by
(accepted + 4) / (predicted + 4), summed over the request's labelled nodes so far, so a
request whose drafts keep failing (or succeeding) shifts its own estimates quickly while
the stream's calibration cells move slowly for all requests."""

PAPER = RecapConfig(cost_aware=False, calibration=False, long_continuation=False, stream_store=False)
"""The paper's exact configuration (``recap-paper``): fixed 63 candidates, 4-token suffix."""

ABLATIONS: dict[str, dict] = {
    "no-cost": {"cost_aware": False},
    "no-calibration": {"calibration": False},
    "no-long": {"long_continuation": False},
    "no-store": {"stream_store": False},
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
"""Named ablation switches (one ingredient changed each). The first four are the cost-aware
method's own ingredients; on ``recap-paper`` they change nothing but ``no-cost``'s flag."""


class RecapProposer(BaseProposer):
    name = "recap"
    stream_state = True
    default_config = RecapConfig()

    def __init__(self, config: RecapConfig | None = None, *, ablation: str | None = None,
                 memory_file: str | PathLike | None = None, **overrides):
        config = config or self.default_config
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
        self.wants_cost = self.config.cost_aware
        self.calibrator = AcceptanceCalibrator(enabled=self.config.calibration)
        self.store = OutputStore(self.config.store_tokens)
        self._store_match = self.store.matcher()
        self._generated: list[int] = []
        self._pending: ChosenTree | None = None
        self._request_expected = 0.0
        self._request_accepted = 0
        self._factor = 1.0
        self.chosen_sizes: list[int] = []
        """Draft nodes chosen at each step of the stream (cost-aware configurations)."""
        self._last_seen: dict[int, int] = {}
        """token -> the last request whose text held it (eviction order of U)."""
        self._requests = 0
        if memory_file is not None:
            self.load_memory(memory_file)

    # ------------------------------------------------------------------ stream / request
    def reset_stream(self) -> None:
        """Forget everything, U included: a new stream starts."""
        if self.memory is not None:
            self.memory.reset_stream()
        self.calibrator.reset()
        self.store.clear()
        self.chosen_sizes = []
        self._last_seen.clear()

    def begin_request(self, prompt: PromptRows) -> None:
        self.prompt = prompt
        if self.config.engine == "numba" and (self.memory is None or self.vocab_size != prompt.vocab_size):
            self.memory = FastMemory(prompt.vocab_size, self.config.top_k)  # another vocabulary: a new stream
        self.vocab_size = prompt.vocab_size
        if self._pending_memory is not None:
            self._install(self._pending_memory, prompt.vocab_size)
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
        self.automaton = SuffixAutomaton(prompt.ids.tolist()) if self._continues else SuffixAutomaton()
        self._generated = []
        self._pending = None
        self._request_expected = 0.0
        self._request_accepted = 0
        self._factor = 1.0
        if self.config.stream_store:
            self._store_match = self.store.matcher()
            self._store_match.sync(prompt.ids.tolist())

    @property
    def _continues(self) -> bool:
        """Whether the request's suffix automaton is kept (a continuation can be drafted)."""
        return bool(self.config.suffix_tokens) or self.config.long_continuation

    def end_request(self) -> None:
        if self.config.stream_store:
            self.store.add(self._generated)
        if self.config.max_memory_rows is not None:
            self._evict(self.config.max_memory_rows)
        if not self.config.persistent_context:
            self.memory.reset_request()
        self._pending = None

    def _evict(self, bound: int) -> None:
        """Keep at most ``bound`` U rows: those whose token was most recently in a request."""
        self._requests += 1
        for token in (*self.prompt.ids.tolist(), *self._generated):
            self._last_seen[int(token)] = self._requests
        keys, _, _ = self.memory.unigram_arrays()
        if len(keys) <= bound:
            return
        age = np.array([self._last_seen.get(int(k), 0) for k in keys])
        evicted = keys[np.argsort(age, kind="stable")[: len(keys) - bound]]
        self.memory.drop_unigram(evicted)
        for key in evicted.tolist():
            self._last_seen.pop(key, None)

    def memory_counts(self) -> tuple[int, int, int]:
        """Rows held by (U, C, G)."""
        if self.memory is None:
            return 0, 0, 0
        if isinstance(self.memory, FastMemory):
            return self.memory.counts()
        return len(self.memory.unigram), len(self.memory.bigram), len(self.memory.trigram)

    # ------------------------------------------------------------------ drafting
    def propose(self, history: Sequence[int], limits: StepLimits | None = None) -> DraftTree:
        self.sync_automaton(history)
        self._context = list(history[-3:])
        if not self.config.scored:  # the paper's tree
            tokens, parents, depths, _ = self.search(self._context)
            self.add_suffix(tokens, parents, depths)
            return DraftTree._trusted(tokens, parents, depths)
        return self.select(self.candidates(history), limits)

    def select(self, candidates: Candidates, limits: StepLimits | None) -> DraftTree:
        """The step's tree: the cost-optimal prefix of the candidates (`recap.core.chooser`);
        without a cost profile (or with ``cost_aware`` off), the best ``budget`` of them."""
        cost = limits.cost if limits is not None and self.config.cost_aware else None
        context_len = limits.context_len if limits is not None else 0
        cap = self.config.budget if cost is None else None
        if limits is not None and limits.max_nodes is not None:
            cap = limits.max_nodes if cap is None else min(cap, limits.max_nodes)
        factor = (self._request_accepted + REQUEST_PSEUDO) / (self._request_expected + REQUEST_PSEUDO) \
            if self.config.calibration else 1.0
        if factor != 1.0:
            candidates.scale(factor)
        self._factor = factor
        tree, chosen = choose(candidates, cost, context_len, cap)
        self._pending = chosen
        self.chosen_sizes.append(len(tree))
        return tree

    def candidates(self, history: Sequence[int]) -> Candidates:
        """Every node this step could draft, with its acceptance estimate: the recycled
        tree, then the request's and the store's continuations merged into it."""
        config = self.config
        calibrator = self.calibrator
        if isinstance(self.memory, FastMemory):
            tokens, parents, depths, q = self.memory.build_tree(
                context_of(self._context), config.budget, config.max_depth, config.width, config.top_k,
                self._eta_array, self._prior_array, config.fusion, self._excluded_mask)
        else:
            tokens, parents, depths, q = (np.asarray(a) for a in self.search(self._context))
            q = q.astype(np.float64)
        candidates = Candidates(tokens, parents, depths, calibrator.recycled(q, depths), recycled_cells(q, depths))
        if self._continues:
            length, end = self.automaton.longest_match()
            if length:
                chain = self._clean(self.automaton.tokens[end + 1 : end + 1 + config.continuation_length(length)])
                cells = continuation_cells(REQUEST, length, np.arange(1, len(chain) + 1))
                candidates.add_chain(chain, calibrator.estimate(cells), cells)
        if config.stream_store and len(self.store):
            self._store_match.sync(history)
            length, chain = self._store_match.continuation(config.max_continuation)
            if length:
                chain = self._clean(chain[: config.continuation_length(length)])
                cells = continuation_cells(STORE, length, np.arange(1, len(chain) + 1))
                candidates.add_chain(chain, calibrator.estimate(cells), cells)
        return candidates

    def _clean(self, chain: Sequence[int]) -> list[int]:
        """The chain up to its first excluded (image) token."""
        out = []
        for token in chain:
            if token in self._excluded:
                break
            out.append(int(token))
        return out

    def sync_automaton(self, history: Sequence[int]) -> None:
        """Feed the automaton (and the request's output) the committed tokens not seen yet:
        the first is the prefill's, the others arrived through ``observe``."""
        if self._continues:
            self.automaton.sync(history)
        if self.config.scored:
            self._generated.extend(history[len(self.prompt.ids) + len(self._generated):])

    def search(self, context: Sequence[int]) -> tuple[list[int], list[int], list[int], list[float]]:
        """Lookup + fusion + best-first search: (tokens, parents, depths, q) of the tree, q
        the fused probability of each node's token under its parent's context."""
        config = self.config
        if isinstance(self.memory, FastMemory):
            tokens, parents, depths, q = self.memory.build_tree(
                context_of(context), config.budget, config.max_depth, config.width, config.top_k, self._eta_array,
                self._prior_array, config.fusion, self._excluded_mask)
            return tokens.tolist(), parents.tolist(), depths.tolist(), q.tolist()
        builder, q = self.build_tree(context)
        return builder.tokens, builder.parents, builder.depths, q

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
        if (self._excluded and not self._excluded.isdisjoint(tokens)) or len(set(tokens)) < len(tokens):
            # no image tokens, and each token once (a loaded row can pad with repeated ids)
            seen: set[int] = set()
            kept = []
            for t, p in zip(tokens, probs):
                if t not in self._excluded and t not in seen:
                    seen.add(t)
                    kept.append((t, p))
            tokens, probs = [t for t, _ in kept], [p for _, p in kept]
        if len(tokens) > config.width:
            tokens, probs = tokens[: config.width], probs[: config.width]
        self._fusion_cache[key] = (tokens, probs)
        return tokens, probs

    def build_tree(self, context: Sequence[int]) -> tuple[TreeBuilder, list[float]]:
        """Best-first expansion by path score prod_j eta_j q(z_j | h_j).

        Children of a node are sorted by q, so the heap only ever holds, per expanded node,
        its best not-yet-added child: popping a child pushes its next sibling and its own
        first child. ``fused`` keeps each child token once, so no duplicate check is needed
        (a repeated child would re-expand the same subtree again and again).
        """
        config = self.config
        etas = self._etas
        self._fusion_cache.clear()
        padded = [None, None, *context][-3:]
        root_context = (padded[0], padded[1], padded[2])
        fused = self.fused
        builder = TreeBuilder()
        add = builder.add
        qs: list[float] = []
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
            known = len(builder.tokens)
            node = add(parent, token)
            if len(builder.tokens) > known:  # a repeated token in a row reuses its node: one q per node
                qs.append(probs[index])
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
        return builder, qs

    # ------------------------------------------------------------------ learning
    def observe(self, step: VerifiedTree) -> None:
        self.refresh(step)
        self.absorb(step)

    def absorb(self, step: VerifiedTree) -> None:
        """What a step teaches besides the rows: the committed text (automaton, output) and
        the drafted nodes' outcomes (calibration)."""
        committed = step.committed
        if self._continues:
            for token in committed:
                self.automaton.extend(token)
        if self.config.scored:
            self._generated.extend(committed)
            if self._pending is not None and self._pending.tree is step.tree:
                self._learn(step)
            self._pending = None

    def _learn(self, step: VerifiedTree) -> None:
        """Label every drafted node whose parent was accepted, and calibrate on it."""
        chosen = self._pending
        n = len(step.tree)
        if not n:
            return

        accepted = np.zeros(n + 1, dtype=bool)
        accepted[0] = True
        accepted[np.asarray(step.accepted, dtype=np.int64) + 1] = True
        labelled = accepted[step.tree.parents + 1]
        outcome = accepted[1:][labelled]
        self.calibrator.record(chosen.probs[labelled], outcome)
        self._request_expected += float(chosen.probs[labelled].sum()) / self._factor
        self._request_accepted += int(outcome.sum())
        cells, repeats = chosen.labelled_cells(labelled)
        self.calibrator.update(cells, np.repeat(outcome, repeats))

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
        """Write the stream's persistent state to ``path``: U, the output store and the
        calibration counts (see `recap.core.persistence`; atomic, durable)."""
        from recap.core.persistence import save_token_memory

        if self.vocab_size is None or self.memory is None:
            raise InputError("nothing to save yet: the memory's vocabulary is known after the first request")
        calibration = (self.calibrator.trials, self.calibrator.accepts) if self.config.calibration else None
        save_token_memory(path, *self.memory.unigram_arrays(), vocab_size=self.vocab_size,
                          store=np.asarray(self.store.flat(), dtype=np.int64), calibration=calibration)

    def load_memory(self, path: str | PathLike) -> None:
        """Read a memory file now (errors surface here); it is installed at the next request,
        once the target's vocabulary is known and checked."""
        from recap.core.persistence import read_token_memory

        self._pending_memory = read_token_memory(path)

    def _install(self, saved, vocab_size: int) -> None:
        from recap.core.persistence import MemoryFileError

        saved.install(self.memory, vocab_size)
        if self.config.stream_store:
            self.store.restore(saved.store.tolist())
        if saved.calibration is not None and self.config.calibration:
            try:
                self.calibrator.restore(*saved.calibration)
            except ValueError as error:
                raise MemoryFileError(f"memory file {saved.path}: {error}") from None


class RecapPaperProposer(RecapProposer):
    """The paper's exact RECAP (`PAPER`): a fixed 63-candidate tree plus a 4-token suffix
    continuation every step, nothing cost-aware. Kept as the reproduction row of every table."""

    name = "recap-paper"
    default_config = PAPER
