"""RECAP: recycle the target's own Top-K predictions as drafts.

propose: best-first tree over fused memory rows + suffix-automaton continuations.
observe: every evaluated node's row refreshes U, C and G; committed tokens extend the automaton.
Memory, fusion and the tree search run compiled, in RECAP's one engine (`recap.core.fast`);
its readable pure-Python oracle is ``tests/reference_recap.py``.

Two configurations share this code:

- ``recap-paper`` (`PAPER`): the paper's exact method: 63 best-first candidates plus a
  4-token continuation of the request's suffix match, the same tree every step.
- ``recap`` (the default, cost-aware): every candidate node gets an estimate of the
  probability that it is accepted once its parent is (`recap.core.calibration`, learned
  online within the stream). Candidates are the recycled tree, the request's suffix
  continuation (16 tokens per matched token, at most what the request can still use) and a
  continuation from the stream's earlier outputs (`recap.core.store`), merged into one tree.
  Ordered by the probability that their whole path is accepted, every prefix is a valid tree; the step
  drafts the prefix that maximises (1 + expected accepted tokens) / predicted verify time
  (`recap.core.chooser`, with the caller's `StepLimits.cost`), N = 0 included.

One proposer object is one *stream*: U (token-keyed memory), the calibrator and the output
store persist across its requests; C/G and the automaton are per request.
``reset_stream()`` starts a new stream.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from os import PathLike
from typing import TYPE_CHECKING

import numpy as np

from recap.core import NOT_COMPUTED, ROOT, DraftOffer, DraftTree, PromptRows, StepLimits, VerifiedTree, first_eligible
from recap.core.calibration import (
    EVIDENCE_CELLS,
    LEGACY_CELLS,
    REQUEST,
    STORE,
    AcceptanceCalibrator,
    is_recycled,
    recycled_cells,
    recycled_prior,
)
from recap.core.chooser import Candidates, ChosenSizes, ChosenTree, choose, rank
from recap.core.fast import FUSION_MODES, MAIN, PRIORS, FastMemory, context_of
from recap.core.steps import RowsWanted
from recap.core.store import OutputStore, StoreMatch
from recap.core.suffix import SuffixAutomaton
from recap.core.timing import StageTimer
from recap.errors import InputError
from recap.proposers.base import BaseProposer

if TYPE_CHECKING:
    from recap.core.persistence import MemorySnapshot

SEED_PROMPT = {"all": "first", "answers": "answers", "none": "none"}
"""`RecapConfig.seed_prompt` -> the prompt rows the proposer asks prefill for."""


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
    cost_aware: bool = True
    """Choose each step's tree size from the verify-cost profile; False: always draft
    ``budget`` candidates (plus the continuation), as the paper does."""
    calibration: bool = True
    """Learn acceptance probabilities online; False: keep the conservative priors."""
    long_continuation: bool = True
    """Continuations of clamp(``continuation_growth`` x match length, 2,
    ``max_continuation``) tokens, never longer than the request's remaining tokens can use
    (the chooser then prices each token by the measured verify cost); False:
    ``suffix_tokens``."""
    continuation_growth: float = 16.0
    """Chain tokens offered per matched token. The offer only bounds what the chooser may
    take: the estimates decide where the chain stops. SAM's 4 (a hard cap, since SAM drafts
    all it offers) cut long copies short where a chain had been accepted whole and the
    calibration trusted more (docs/methods.md, "How far a continuation runs")."""
    max_continuation: int = 256
    """Ceiling of a continuation (host work stays bounded); the remaining budget usually
    binds first."""
    end_aware: bool = True
    """Credit a draft that can finish the request with the step it saves
    (`recap.core.chooser`); False: every step is priced as one of many alike."""
    stream_store: bool = True
    """Also draft continuations from the stream's earlier outputs."""
    store_tokens: int = 16384
    """Bound of the output store (tokens, per stream)."""
    max_memory_rows: int | None = None
    """Bound of U (rows, per stream; None: one per vocabulary token at most). Past it, after a
    request, the rows whose token was least recently in a request's text are evicted."""
    seed_prompt: str = "answers"
    """Which prompt rows seed U at prefill: ``all`` (each eligible token's first row, the
    paper's step, kept by ``recap-paper``), ``answers`` (only those inside the prompt's
    earlier assistant turns, `TargetModel.answer_mask`) or ``none``. The prefill runs the LM
    head on those rows alone (a fifth of a prompt row's arithmetic on SmolLM2). ``answers``
    by default: a row of the user's text predicts how the *prompt* goes on, which the suffix
    automaton drafts already, and it overwrites the row U learned from earlier answers; rows
    of an earlier answer are what a turn that repeats it needs (docs/methods.md, "Prompt
    seeding")."""

    def __post_init__(self) -> None:
        if self.fusion not in FUSION_MODES:
            raise InputError(f"unknown fusion mode {self.fusion!r}; choose one of: {', '.join(FUSION_MODES)}")
        for name in ("top_k", "width", "max_depth"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be at least 1")
        if self.budget < 0 or self.suffix_tokens < 0 or self.max_continuation < 0:
            raise InputError("budget, suffix_tokens and max_continuation cannot be negative")
        if not self.continuation_growth > 0:
            raise InputError(f"continuation_growth must be positive, got {self.continuation_growth!r}")
        if self.seed_prompt not in SEED_PROMPT:
            raise InputError(f"seed_prompt must be one of {', '.join(SEED_PROMPT)}, got {self.seed_prompt!r}")
        if self.store_tokens < 2:
            raise InputError("store_tokens must be at least 2")
        if self.max_memory_rows is not None and self.max_memory_rows < 1:
            raise InputError("max_memory_rows must be at least 1")

    @property
    def scored(self) -> bool:
        """Whether drafts carry acceptance estimates (anything beyond the paper's tree)."""
        return self.cost_aware or self.long_continuation or self.stream_store

    def continuation_length(self, match_length: int, room: int | None = None) -> int:
        """Chain tokens a match of ``match_length`` earns; ``room``: the deepest draft the
        request can still use (remaining tokens - 1), None when not known."""
        if not self.long_continuation:
            return self.suffix_tokens if self.suffix_tokens else 0
        length = max(2, min(self.max_continuation, int(self.continuation_growth * match_length)))
        return length if room is None else max(0, min(length, room))

    def depth_prior(self, depth: int) -> float:
        return self.depth_priors[depth - 1] if depth <= len(self.depth_priors) else self.tail_depth_prior


REQUEST_PSEUDO = 4.0
"""Pseudo-count of the request-level correction: within a request every recycled estimate is
scaled by (accepted + 4) / (predicted + 4), summed over the request's labelled recycled nodes
so far, so a request whose recycled drafts keep failing (or succeeding) shifts its own
estimates quickly while the stream's calibration cells move slowly for all requests.
Continuations are left out: their evidence is their own (match length, run so far)."""

PAPER = RecapConfig(cost_aware=False, calibration=False, long_continuation=False, stream_store=False,
                    seed_prompt="all")
"""The paper's exact configuration (``recap-paper``): fixed 63 candidates, 4-token suffix."""

ABLATIONS: dict[str, dict] = {
    "no-cost": {"cost_aware": False},
    "no-calibration": {"calibration": False},
    "no-long": {"long_continuation": False},
    "no-store": {"stream_store": False},
    "no-end": {"end_aware": False},
    "no-confidence": {"fusion": "no-confidence"},
    "no-prior": {"fusion": "no-prior"},
    "uniform": {"fusion": "uniform"},
    "gate": {"fusion": "gate"},
    "backoff": {"fusion": "backoff"},
    "unigram": {"fusion": "unigram"},
    "reset-U": {"persistent_unigram": False},
    "no-suffix": {"suffix_tokens": 0},
    "no-prompt-seed": {"seed_prompt": "none"},
    "prompt-seed-all": {"seed_prompt": "all"},
    "persistent-CG": {"persistent_context": True},
}
"""Named ablation switches (one ingredient changed each). The first five are the cost-aware
method's own ingredients; on ``recap-paper`` they change nothing but ``no-cost``'s flag."""


@dataclass
class RecapRequest:
    """One request's state, apart from the stream's (U, calibration, output store): what a
    forked request (`RecapProposer.fork_request`) has of its own. ``key`` names its C and G in
    the stream's shared `FastMemory`."""

    key: int
    prompt: PromptRows | None = None
    context: tuple[int, int, int] = (-1, -1, -1)
    """(u, v, x): the last three tokens of the history at the latest propose, -1 before its start."""
    automaton: SuffixAutomaton = field(default_factory=SuffixAutomaton)
    """The prompt and the answer so far, for the continuation."""
    store_match: StoreMatch | None = None
    """The history's match in the stream's earlier outputs."""
    generated: list[int] = field(default_factory=list)
    pending: ChosenTree | None = None
    """The tree chosen at the latest propose, whose outcome calibrates."""
    expected: float = 0.0
    accepted: int = 0
    """Estimated and accepted recycled nodes: the request's correction factor."""
    factor: float = 1.0
    steps: int = 0
    """Verified steps so far."""


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
        self.memory: FastMemory | None = None  # it needs the vocabulary size: made at the first request
        self.vocab_size: int | None = None
        self._excluded: frozenset[int] = frozenset()
        self._excluded_mask: np.ndarray | None = None
        self._pending_memory = None
        self._eta_array = np.array([0.0] + [self.config.depth_prior(d) for d in range(1, self.config.max_depth + 1)],
                                   dtype=np.float64)
        self._prior_array = np.array(self.config.priors, dtype=np.float64)
        self.wants_cost = self.config.cost_aware
        self.calibrator = AcceptanceCalibrator(enabled=self.config.calibration)
        self.store = OutputStore(self.config.store_tokens)
        self._stages = StageTimer()
        self.chosen_sizes = ChosenSizes()
        """Draft nodes chosen at each step of the stream (cost-aware configurations): the
        latest steps and running totals, bounded for a stream that lives as long as a server."""
        self._last_seen: dict[int, int] = {}
        """token -> the last request whose text held it (eviction order of U)."""
        self._requests = 0
        self._parent: RecapProposer | None = None
        """The stream a forked request (`fork_request`) belongs to; None for the stream itself."""
        self.request = RecapRequest(MAIN, store_match=self.store.matcher())
        """The request in flight (the stream's own; a fork's on `fork_request`)."""
        self._keys = itertools.count(MAIN + 1)
        """The keys of the stream's forked requests."""
        if memory_file is not None:
            self.load_memory(memory_file)

    @property
    def rows_wanted(self) -> RowsWanted:
        """The rows U seeds from (`RecapConfig.seed_prompt`): ``first`` for ``all``,
        ``answers``, or ``none`` (the prefill runs the head on its last row alone)."""
        return SEED_PROMPT[self.config.seed_prompt]

    # ------------------------------------------------------------------ stream / request
    def reset_stream(self) -> None:
        """Forget everything, U included: a new stream starts."""
        if self.memory is not None:
            self.memory.reset_stream()
        self.calibrator.reset()
        self.store.clear()
        self.chosen_sizes.clear()
        self._last_seen.clear()
        self._requests = 0

    def begin_request(self, prompt: PromptRows) -> None:
        saved, self._pending_memory = self._pending_memory, None  # a file that fails is reported once
        if saved is not None:
            self._validate(saved, prompt.vocab_size)  # before anything changes: no half-installed stream
        parent = self._parent
        if parent is not None and parent.memory is not None and parent.vocab_size == prompt.vocab_size:
            self.memory = parent.memory  # what another fork made since this one was
        if self.memory is None or self.vocab_size != prompt.vocab_size:
            self.memory = FastMemory(prompt.vocab_size, self.config.top_k)  # another vocabulary: a new stream
            if parent is not None:  # a fork that began first: the stream takes its memory
                parent._adopt(self.memory, prompt.vocab_size)
        self.vocab_size = prompt.vocab_size
        if saved is not None:
            self._install(saved, prompt.vocab_size)
        if not self.config.persistent_unigram:
            self.memory.reset_stream()
        elif not self.config.persistent_context:
            self.memory.reset_request(self.request.key)
        seeding = self._seeding(prompt)
        if seeding is not None:
            self.memory.seed_from_prompt(prompt.ids, prompt.topk_ids, prompt.topk_logits, seeding)
        if prompt.excluded_tokens != self._excluded or self._excluded_mask is None:
            self._excluded = prompt.excluded_tokens
            self._excluded_mask = None
            if self._excluded:
                self._excluded_mask = np.zeros(prompt.vocab_size, dtype=bool)
                self._excluded_mask[[t for t in self._excluded if 0 <= t < prompt.vocab_size]] = True
        self.request = RecapRequest(
            self.request.key, prompt,
            automaton=SuffixAutomaton(prompt.ids.tolist()) if self._continues else SuffixAutomaton(),
            store_match=self.store.matcher() if self.config.stream_store else self.request.store_match)
        if self.config.stream_store:
            self.request.store_match.begin_answer(len(prompt.ids))

    def _seeding(self, prompt: PromptRows) -> np.ndarray | None:
        """The eligible mask U seeds from (None: no seeding). ``answers``: the first rows the
        prefill computed besides its last (the target picked those inside earlier answers)."""
        mode = self.config.seed_prompt
        if mode == "all":
            return prompt.eligible
        if mode == "none" or not len(prompt.topk_ids):
            return None
        positions = first_eligible(prompt.ids, prompt.eligible)
        positions = positions[positions < len(prompt.ids) - 1]
        positions = positions[np.asarray(prompt.topk_ids)[positions, 0] != NOT_COMPUTED]
        if not len(positions):
            return None
        seeding = np.zeros(len(prompt.ids), dtype=bool)
        seeding[positions] = True
        return seeding

    @property
    def _continues(self) -> bool:
        """Whether the request's suffix automaton is kept (a continuation can be drafted)."""
        return bool(self.config.suffix_tokens) or self.config.long_continuation

    def end_request(self) -> None:
        if self.config.stream_store:
            self.store.add(self.request.generated)
        if self._parent is not None:  # a forked request: its C and G go, its U rows stay the stream's
            self.memory.end_request(self.request.key)
        else:
            if self.config.max_memory_rows is not None:
                self._evict(self.config.max_memory_rows)
            if not self.config.persistent_context:
                self.memory.reset_request(self.request.key)
        self.request.pending = None

    def fork_request(self) -> RecapProposer:
        """A proposer for a request that overlaps another of this stream (batched serving),
        keyed by a request key of its own the way SuffixDecoding keys its per-request trees: it
        reads and writes the stream's U, calibration and output store (one thread runs every
        request of a stream, so their updates simply interleave, and no request's learning
        waits for its end), with C, G (under its key in the shared `FastMemory`), the automaton
        and the rest of the request state its own. A file still waiting to be installed
        (loaded without a vocabulary) is installed first, at the file's vocabulary, for the
        same reason as in `load_memory`."""
        if self._pending_memory is not None:
            self._install_now(self._pending_memory, self._pending_memory.vocab_size)
        child = copy.copy(self)
        child._stages = StageTimer()
        child._parent = self
        child.request = RecapRequest(next(self._keys), store_match=self.store.matcher())
        return child

    def _adopt(self, memory: FastMemory, vocab_size: int) -> None:
        """Take the memory a fork made for a vocabulary this stream had none for."""
        self.memory, self.vocab_size = memory, vocab_size

    def _evict(self, bound: int) -> None:
        """Keep at most ``bound`` U rows: those whose token was most recently in a request."""
        self._requests += 1
        for token in (*self.request.prompt.ids.tolist(), *self.request.generated):
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
        return self.memory.counts(self.request.key)

    # ------------------------------------------------------------------ drafting
    def propose(self, history: Sequence[int], limits: StepLimits | None = None) -> DraftTree:
        """The step's tree. Its parts are timed on the proposer itself (`stage_times`): the
        paper's tree as ``search`` and ``suffix``, the cost-aware one as ``candidates`` and
        ``choice``."""
        stages = self._stages
        stages.begin("propose")
        self.sync_automaton(history)
        self.request.context = context_of(history)
        if not self.config.scored:  # the paper's tree
            stages.lap("suffix")
            tokens, parents, depths, _ = self.search(self.request.context)
            stages.lap("search")
            self.add_suffix(tokens, parents, depths)
            stages.lap("suffix")
            tree = DraftTree._trusted(tokens, parents, depths)
            stages.lap("search")
            return tree
        candidates = self.candidates(history, limits.max_depth if limits is not None else None)
        stages.lap("candidates")
        tree = self.select(candidates, limits)
        stages.lap("choice")
        return tree

    def stage_times(self) -> dict[str, dict[str, float]]:
        """Seconds of the parts of the latest ``propose`` (``search``: lookup, fusion and the
        best-first search in one compiled call, plus the tree's construction; ``suffix``:
        automaton sync and the continuation's insertion; or ``candidates`` and ``choice``)
        and ``observe`` (``refresh`` of U/C/G; ``automaton``: the automaton, output and
        calibration updates)."""
        return self._stages.last

    def offer(self, history: Sequence[int], limits: StepLimits | None = None) -> DraftOffer | None:
        """The cost-aware candidates best first, for a batch's shared budget (the paper's tree
        and the fixed-budget ablation size themselves: None)."""
        if not (self.config.scored and self.config.cost_aware):
            return None
        self.sync_automaton(history)
        self.request.context = context_of(history)
        limits = limits if limits is not None else StepLimits()
        depth = limits.max_depth
        ranked = rank(self.candidates(history, depth), limits.max_nodes, depth, limits.stop_tokens)

        def take(size: int) -> DraftTree:
            tree, self.request.pending = ranked.take(size)
            self.chosen_sizes.append(len(tree))
            return tree

        return DraftOffer(ranked.gains, take)

    def select(self, candidates: Candidates, limits: StepLimits | None) -> DraftTree:
        """The step's tree: the cost-optimal prefix of the candidates (`recap.core.chooser`);
        without a cost profile (or with ``cost_aware`` off), the best ``budget`` of them."""
        limits = limits if limits is not None else StepLimits()
        cost = limits.cost if self.config.cost_aware else None
        cap = self.config.budget if cost is None else None
        if limits.max_nodes is not None:
            cap = limits.max_nodes if cap is None else min(cap, limits.max_nodes)
        tree, chosen = choose(candidates, cost, limits.context_len, cap, limits.max_depth, self.config.end_aware,
                              limits.stop_tokens)
        self.request.pending = chosen
        self.chosen_sizes.append(len(tree))
        return tree

    def candidates(self, history: Sequence[int], room: int | None = None) -> Candidates:
        """Every node this step could draft, with its acceptance estimate: the recycled
        tree, then the request's and the store's continuations merged into it (chains no
        deeper than ``room``, the deepest draft the request can still use)."""
        config = self.config
        calibrator = self.calibrator
        tokens, parents, depths, q = self._tree_arrays(self.request.context)
        recycled = calibrator.recycled(q, depths)
        # The request's correction is learned on recycled nodes and applied to them only: a
        # factor per node compounds along a path, so on a 30-token chain 0.95 would be 0.2.
        factor = (self.request.accepted + REQUEST_PSEUDO) / (self.request.expected + REQUEST_PSEUDO) \
            if config.calibration else 1.0
        self.request.factor = factor
        if factor != 1.0:
            recycled = np.minimum(recycled * factor, 0.999)
        candidates = Candidates(tokens, parents, depths, recycled, recycled_cells(q, depths),
                                priors=recycled_prior(q))
        opening = not self.request.steps  # the match rests on the prompt alone (see `calibration`)
        if self._continues:
            length, end = self.request.automaton.longest_match()
            if length:
                size = config.continuation_length(length, room)
                chain = self._clean(self.request.automaton.tokens[end + 1 : end + 1 + size])
                candidates.add_chain(chain, *calibrator.continuation(REQUEST, length, np.arange(1, len(chain) + 1),
                                                                      opening))
        if config.stream_store and len(self.store):
            match = self.request.store_match
            match.sync(history)
            if match.length:
                length, chain = match.continuation(config.continuation_length(match.length, room))
                chain = self._clean(chain)
                candidates.add_chain(chain, *calibrator.continuation(STORE, length, np.arange(1, len(chain) + 1),
                                                                      opening))
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
            self.request.automaton.sync(history)
        if self.config.scored:
            self.request.generated.extend(history[len(self.request.prompt.ids) + len(self.request.generated):])

    def search(self, context: tuple[int, int, int]) -> tuple[list[int], list[int], list[int], list[float]]:
        """Lookup + fusion + best-first search after ``context`` (`context_of`) in one compiled
        call (`FastMemory.build_tree`): (tokens, parents, depths, q) of the tree as lists, q
        the fused probability of each node's token under its parent's context."""
        return tuple(array.tolist() for array in self._tree_arrays(context))

    def _tree_arrays(self, context: tuple[int, int, int]) -> tuple[np.ndarray, ...]:
        """`search` as arrays (tokens, parents, depths, q), what the cost-aware path reads."""
        config = self.config
        return self.memory.build_tree(context, config.budget, config.max_depth, config.width, config.top_k,
                                      self._eta_array, self._prior_array, config.fusion, self._excluded_mask,
                                      request=self.request.key)

    def add_suffix(self, tokens: list[int], parents: list[int], depths: list[int]) -> None:
        """Insert the automaton's continuation along a root path, reusing existing nodes;
        fused scores are untouched (the new nodes only extend the tree)."""
        if not self.config.suffix_tokens:
            return
        continuation = []
        for token in self.request.automaton.continuation(self.config.suffix_tokens):
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

    # ------------------------------------------------------------------ learning
    def observe(self, step: VerifiedTree) -> None:
        stages = self._stages
        stages.begin("observe")
        self.refresh(step)
        stages.lap("refresh")
        self.absorb(step)
        stages.lap("automaton")

    def absorb(self, step: VerifiedTree) -> None:
        """What a step teaches besides the rows: the committed text (automaton, output) and
        the drafted nodes' outcomes (calibration)."""
        committed = step.committed
        if self._continues:
            for token in committed:
                self.request.automaton.extend(token)
        self.request.steps += 1
        if self.config.scored:
            self.request.generated.extend(committed)
            if self.request.pending is not None and self.request.pending.tree is step.tree:
                self._learn(step)
            self.request.pending = None

    def _learn(self, step: VerifiedTree) -> None:
        """Label every drafted node whose parent was accepted, and calibrate on it."""
        chosen = self.request.pending
        n = len(step.tree)
        if not n:
            return

        accepted = np.zeros(n + 1, dtype=bool)
        accepted[0] = True
        accepted[np.asarray(step.accepted, dtype=np.int64) + 1] = True
        labelled = accepted[step.tree.parents + 1]
        if step.kept is not None:  # past EOS the request is over: no outcome there is a miss
            labelled &= step.tree.depths <= step.kept
        outcome = accepted[1:][labelled]
        self.calibrator.record(chosen.probs[labelled], outcome)
        # The request's correction learns from nodes only the recycled tree offered (their
        # estimate is the corrected recycled one), as it is applied to those only.
        only_recycled = is_recycled(chosen.cell_array[:, 0]) & (chosen.cell_array[:, 1] < 0)
        mine = labelled & only_recycled
        self.request.expected += float(chosen.probs[mine].sum()) / self.request.factor
        self.request.accepted += int(accepted[1:][mine].sum())
        cells, repeats, priors = chosen.labelled_cells(labelled)
        self.calibrator.update(cells, np.repeat(outcome, repeats), priors)

    def refresh(self, step: VerifiedTree) -> None:
        """Every evaluated node's row into U, C and G under its own path context."""
        self.memory.refresh(self.request.context, step.tree.tokens, step.tree.parents, step.topk_ids, step.topk_logits,
                            self.config.fusion != "unigram", request=self.request.key)

    # ------------------------------------------------------------------ persistence
    def save_memory(self, path: str | PathLike, metadata: dict[str, str] | None = None) -> None:
        """Write the stream's persistent state to ``path`` (`memory_snapshot`, then its write:
        atomic, durable; see `recap.core.persistence`). ``metadata``: extra string fields
        stored with the file."""
        self.memory_snapshot().write(path, metadata)

    def memory_snapshot(self) -> MemorySnapshot:
        """A copy of what `save_memory` writes: U, the output store, the calibration counts and
        each token's last request (the memory bound's eviction order, so a restart keeps
        evicting the least recently seen). The copy is the only cost to the caller: a server
        takes it on its decoder thread and writes it on another (`recap.serve.saver`)."""
        from recap.core.persistence import token_memory_snapshot

        if self.vocab_size is None or self.memory is None:
            raise InputError("nothing to save yet: the memory's vocabulary is known after the first request")
        calibrator = self.calibrator
        calibration = (calibrator.trials, calibrator.accepts, calibrator.expected) if self.config.calibration else None
        seen = np.fromiter(self._last_seen.items(), dtype=np.dtype((np.int64, 2)), count=len(self._last_seen))
        return token_memory_snapshot(*self.memory.unigram_arrays(), vocab_size=self.vocab_size,
                                     store=np.asarray(self.store.flat(), dtype=np.int64), calibration=calibration,
                                     last_seen=(seen[:, 0], seen[:, 1]))

    def load_memory(self, path: str | PathLike, vocab_size: int | None = None) -> None:
        """Read and check a memory file now: every error (damage, rows wider than ``top_k``,
        calibration counts for other cells, another vocabulary than ``vocab_size`` where the
        caller knows it) surfaces here as `MemoryFileError`, before the stream changes. With
        ``vocab_size`` (a server's tenant streams) it is installed now, so a request forked
        from this stream before the stream's own request begins (`fork_request`) drafts from
        it, and no later install resets the output store and calibration the fork shares;
        without, at the next request, once the target's vocabulary is known and checked."""
        from recap.core.persistence import read_token_memory

        saved = read_token_memory(path)
        self._validate(saved, vocab_size)
        if vocab_size is None:
            self._pending_memory = saved
        else:
            self._install_now(saved, vocab_size)

    def _install_now(self, saved, vocab_size: int) -> None:
        """Install a checked file into this stream before its next request begins."""
        self._pending_memory = None
        if self.memory is None or self.vocab_size != vocab_size:
            self.memory = FastMemory(vocab_size, self.config.top_k)
        self.vocab_size = vocab_size
        self._install(saved, vocab_size)

    def _validate(self, saved, vocab_size: int | None) -> None:
        """Raise `MemoryFileError` if ``saved`` cannot be installed whole into this stream
        (``vocab_size`` None: not known yet), so a bad file never leaves a half-installed one."""
        from recap.core.persistence import MemoryFileError

        if vocab_size is not None and vocab_size != saved.vocab_size:
            raise MemoryFileError(f"memory file {saved.path} was made for a vocabulary of {saved.vocab_size} tokens; "
                                  f"this model has {vocab_size}")
        if len(saved.keys) and not 1 <= saved.ids.shape[1] <= self.config.top_k:
            raise MemoryFileError(f"memory file {saved.path} holds rows of {saved.ids.shape[1]} predictions; this "
                                  f"RECAP keeps {self.config.top_k} (top_k)")
        if saved.calibration is not None and self.config.calibration:
            cells, found = self.calibrator.trials.shape[0], saved.calibration[0].shape[0]
            if found not in (cells, LEGACY_CELLS, EVIDENCE_CELLS):  # older layouts (`AcceptanceCalibrator.restore`)
                raise MemoryFileError(f"memory file {saved.path}: calibration counts for {found} cells; this RECAP "
                                      f"has {cells}")

    def _install(self, saved, vocab_size: int) -> None:
        """Install a file `_validate` accepted (nothing in it can fail half-way)."""
        saved.install(self.memory, vocab_size)
        if self.config.stream_store:
            self.store.restore(saved.store.tolist())
        if saved.calibration is not None and self.config.calibration:
            self.calibrator.restore(*saved.calibration)
        if saved.last_seen is not None:
            tokens, requests = saved.last_seen
            self._last_seen = dict(zip(tokens.tolist(), requests.tolist()))
            self._requests = max(self._requests, int(requests.max(initial=0)))


class RecapPaperProposer(RecapProposer):
    """The paper's exact RECAP (`PAPER`): a fixed 63-candidate tree plus a 4-token suffix
    continuation every step, nothing cost-aware. Kept as the reproduction row of every table."""

    name = "recap-paper"
    default_config = PAPER
