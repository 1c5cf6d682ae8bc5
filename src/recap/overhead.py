"""Host-side overhead of a drafting method, without a model: what one iteration costs the CPU.

A real decode step is propose -> (device forward) -> observe, plus the host work of packing the
tree for the forward. The forward depends on the GPU; everything else is Python and numpy and
is what this module measures. `SyntheticTarget` replaces the model with a seeded numpy Markov
"language", so proposers are replayed on realistic Top-K streams (repetition, confident and
flat rows) at a real vocabulary size, and the target's own time is never counted.

The replay is the real loop: `recap.decoding.Decoding` drives the method's own ``propose`` and
``observe`` on the synthetic target, and the times are the ones the loop measures. Nothing
here re-implements or instruments a method; a method that times its own parts reports them
through ``Proposer.stage_times`` (RECAP does), and those are what the stage split shows.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from recap.core import CostProfile, DraftTree, PromptRows, StepLimits, VerifiedTree
from recap.core.tree import additive_mask
from recap.decoding import Decoding
from recap.proposers import Proposer, make_proposer
from recap.verifier import acceptance
from recap.verifier.protocol import BaseTarget
from recap.verifier.sampling import Sampler

_MASK_MIN = np.float32(np.finfo(np.float32).min)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic): a cheap, seedable hash."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class SyntheticTarget(BaseTarget):
    """A deterministic stand-in for the model: a `recap.verifier.protocol.Target` (greedy only,
    no context limit, no image) that `recap.decoding.decode` drives like a real one. Its
    verify-cost profile is ``cost_profile`` (None: none, so cost-aware methods keep their
    budget); with ``pack_trees`` every ``verify`` also does the host packing a real target
    does before its forward (`pack_tree`) and keeps its time in ``packing_s``.

    The language: every token x has ``candidates`` distinct follow-up tokens around a
    Zipf-Mandelbrot frequency rank, with Zipf-shaped base logits, so frequent tokens and their
    continuations recur (default prompts: ~55% distinct tokens). The previous token v perturbs
    those logits through a hash of (v, x) (``pair_noise``), so the distribution depends on the
    last two tokens. A hash of the last ``window`` tokens (``window_noise``) stands in for
    long-range context and reorders the same candidates: greedy text of a pure order-2 model
    enters a loop within a few dozen tokens whenever tokens repeat at text-like rates, which
    would overstate recycling (``window_noise=0`` gives that model). Non-candidate tokens have
    (implicitly) lower logits, so the Top-K is the top of the candidates; greedy
    continuation is the argmax.
    """

    def __init__(self, vocab_size: int = 49152, *, seed: int = 0, top_k: int = 8, candidates: int = 12,
                 rank_exponent: float = 1.2, rank_offset: float = 10.0, logit_slope: float = 1.6,
                 pair_noise: float = 2.0, window: int = 8, window_noise: float = 4.0,
                 cost_profile: CostProfile | None = None, pack_trees: bool = False):
        if candidates < top_k:
            raise ValueError("candidates must be at least top_k")
        if window < 2:
            raise ValueError("window must be at least 2")
        rng = np.random.default_rng(seed)
        v, c = vocab_size, candidates
        self.vocab_size = vocab_size
        self.top_k = top_k
        self.window = window
        self.eos_token_ids: list[int] = []
        self.excluded_tokens: frozenset[int] = frozenset()
        self._rank_to_token = rng.permutation(v).astype(np.int64)
        weights = (np.arange(v) + rank_offset) ** -rank_exponent
        self._rank_p = weights / weights.sum()
        start = rng.choice(v, size=v, p=self._rank_p)
        gaps = rng.geometric(0.35, (v, c))
        ranks = (start[:, None] + np.cumsum(gaps, axis=1) - gaps[:, :1]) % v  # strictly increasing: distinct
        shuffle = np.argsort(rng.random((v, c)), axis=1)
        self._next = self._rank_to_token[np.take_along_axis(ranks, shuffle, axis=1)]
        self._base = (10.0 - logit_slope * np.log1p(np.arange(c)) + 0.6 * rng.standard_normal((v, c))).astype(
            np.float32)
        self._noise = (np.float32(pair_noise), np.float32(window_noise))
        self._salt = rng.integers(1, 2**63, size=window, dtype=np.uint64)
        self._columns = _GOLDEN * np.arange(1, c + 1, dtype=np.uint64)
        self._tail: list[int] = []
        self._root = -1
        self._tree: DraftTree | None = None
        self.past_len = 0
        self.cost_profile = cost_profile
        self.pack_trees = pack_trees
        self.packing_s = 0.0
        """Seconds of the latest verify's packing (``pack_trees``)."""

    # ---------------------------------------------------------------- the language
    def _uniform(self, key: np.ndarray) -> np.ndarray:
        """(n, candidates) uniforms in [0, 1) from (n,) uint64 keys."""
        bits = _mix(key[:, None] + self._columns) >> np.uint64(40)
        return bits.astype(np.float32) * np.float32(2.0**-24)

    def rows(self, context: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Top-K ids (int64), logits (float32) and argmax after each row of ``context``, an
        (n, window) array of the last tokens, oldest first; -1 = before the text."""
        context = np.asarray(context, dtype=np.int64).reshape(-1, self.window)
        shifted = (context + 1).astype(np.uint64)
        last = context[:, -1]
        pair = _mix(_mix(shifted[:, -2] ^ self._salt[0]) ^ shifted[:, -1])
        whole = np.zeros(len(context), dtype=np.uint64)
        for column in range(self.window):
            whole = _mix(whole ^ shifted[:, column] ^ self._salt[column])
        half = np.float32(0.5)
        logits = (self._base[last] + self._noise[0] * (self._uniform(pair) - half)
                  + self._noise[1] * (self._uniform(whole) - half))
        order = np.argsort(-logits, axis=1, kind="stable")[:, : self.top_k]
        ids = np.take_along_axis(self._next[last], order, axis=1)
        return ids, np.take_along_axis(logits, order, axis=1), ids[:, 0].copy()

    def _context_of(self, tokens: Sequence[int]) -> np.ndarray:
        padded = [-1] * self.window + list(tokens[-self.window:])
        return np.array(padded[-self.window:], dtype=np.int64)[None]

    def sample_prompt(self, length: int = 384, seed: int = 0, temperature: float = 1.0) -> list[int]:
        """A text sampled from the language (not greedy, so prompts differ and do not loop)."""
        rng = np.random.default_rng(seed)
        tokens = [int(self._rank_to_token[rng.choice(self.vocab_size, p=self._rank_p)])]
        for _ in range(length - 1):
            ids, logits, _ = self.rows(self._context_of(tokens))
            p = np.exp((logits[0] - logits[0].max()) / temperature)
            tokens.append(int(ids[0, rng.choice(len(p), p=p / p.sum())]))
        return tokens

    def greedy(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Reference greedy continuation, one token at a time (what every decode must output)."""
        tokens = list(prompt)
        for _ in range(max_new_tokens):
            tokens.append(int(self.rows(self._context_of(tokens))[2][0]))
        return tokens[len(prompt):]

    # ---------------------------------------------------------------- target interface
    def verify_cost(self) -> CostProfile | None:
        return self.cost_profile

    def prefill(self, inputs: Sequence[int] | np.ndarray, sampler: Sampler | None = None) -> tuple[PromptRows, int]:
        """``inputs`` are prompt token ids. Row p is the prediction after prompt token p."""
        self._refuse_sampler(sampler)
        ids = np.asarray(inputs, dtype=np.int64).reshape(-1)
        if not len(ids):
            raise ValueError("empty prompt")
        padded = np.concatenate([np.full(self.window - 1, -1, dtype=np.int64), ids])
        topk_ids, topk_logits, argmax = self.rows(np.lib.stride_tricks.sliding_window_view(padded, self.window))
        self._tail, self._root, self._tree = padded[-(self.window - 1):].tolist(), -1, None
        self.past_len = len(ids)
        rows = PromptRows(ids=ids, topk_ids=topk_ids, topk_logits=topk_logits, eligible=np.ones(len(ids), dtype=bool),
                          vocab_size=self.vocab_size, excluded_tokens=self.excluded_tokens)
        return rows, int(argmax[-1])

    def verify(self, root: int, tree: DraftTree, sampler: Sampler | None = None, position: int = 0) -> VerifiedTree:
        """Top-K and argmax at every packed position (root = 0, node i = i + 1), each from its
        own path context (committed tail, root, then the node's ancestors)."""
        self._refuse_sampler(sampler)
        if self.pack_trees:
            start = time.perf_counter()
            pack_tree(root, tree, self.past_len)
            self.packing_s = time.perf_counter() - start
        tail = len(self._tail)
        extended = np.array([*self._tail, root, *tree.tokens.tolist()], dtype=np.int64)
        # parent[j]: index in `extended` of the token before j on j's path (-1: none).
        parent = np.concatenate([np.arange(-1, tail), tree.parents + 1 + tail])
        column = np.arange(tail, len(extended))
        context = np.empty((len(column), self.window), dtype=np.int64)
        for k in range(self.window - 1, -1, -1):
            context[:, k] = np.where(column >= 0, extended[column], -1)
            column = np.where(column >= 0, parent[column], -1)
        topk_ids, topk_logits, argmax = self.rows(context)
        self._root, self._tree = int(root), tree
        return VerifiedTree(tree=tree, topk_ids=topk_ids, topk_logits=topk_logits, argmax=argmax,
                            accepted=acceptance.greedy(tree, argmax))

    def commit(self, accepted: Sequence[int]) -> None:
        """Root and accepted nodes become context; the bonus token is the next root."""
        if self._tree is None:
            raise RuntimeError("commit() before verify()")
        kept = [self._root, *(int(self._tree.tokens[i]) for i in accepted)]
        self._tail = [*self._tail, *kept][-(self.window - 1):]
        self.past_len += len(kept)
        self._tree = None

    def release(self) -> None:
        self._tree = None


# -------------------------------------------------------------------- the measured host work
def pack_tree(root: int, tree: DraftTree, past_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The host part of `TargetModel.verify` before the forward: packed tokens, positions and the
    additive (N, past_len + N) mask, as `recap.verifier.attention.tree_attention_mask` builds it
    (float32 here; the real target then converts to torch and copies to the device)."""
    tokens, depths = tree.packed(root)
    return tokens, depths + past_len, additive_mask(tree.ancestor_matrix(), past_len, _MASK_MIN)


REPLAY_COST = CostProfile.linear(0.06)
"""The verify-cost curve cost-aware proposers are given in the replay (t(64) ~ 4.8 t(1), as
measured for SmolLM2 fp32 on a 2-core CPU): the choice is made, its host cost counted. A
linear profile never corrects itself online, so the trajectory does not depend on how fast
this machine runs the synthetic target."""


@dataclass
class _Replay:
    """Per counted iteration: stage times (seconds), tree sizes and accepted counts."""

    times: dict[str, list[float]] = field(default_factory=dict)
    sizes: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def add(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds)


class _Profiled:
    """A proposer seen through cProfile: the profiler runs only inside ``propose`` and
    ``observe`` (delegation, the method itself untouched)."""

    def __init__(self, inner: Proposer, profiler: cProfile.Profile):
        self.inner, self.profiler = inner, profiler
        self.name, self.stream_state = inner.name, inner.stream_state
        self.wants_cost, self.wants_image_attention = inner.wants_cost, inner.wants_image_attention
        self.rows_wanted = inner.rows_wanted

    def begin_request(self, prompt: PromptRows) -> None:
        self.inner.begin_request(prompt)

    def propose(self, history: Sequence[int], limits: StepLimits | None = None) -> DraftTree:
        self.profiler.enable()
        try:
            return self.inner.propose(history, limits)
        finally:
            self.profiler.disable()

    def observe(self, step: VerifiedTree) -> None:
        self.profiler.enable()
        try:
            self.inner.observe(step)
        finally:
            self.profiler.disable()

    def end_request(self) -> None:
        self.inner.end_request()

    def reset_stream(self) -> None:
        self.inner.reset_stream()

    def set_reference(self, reference: Sequence[int]) -> None:
        self.inner.set_reference(reference)

    def stage_times(self) -> dict[str, dict[str, float]]:
        return self.inner.stage_times()


def _replay(proposer: Proposer, target: SyntheticTarget, prompts: list[list[int]], max_new_tokens: int) -> _Replay:
    """`recap.decoding.Decoding` over ``prompts`` as one stream (greedy, no EOS), keeping the
    loop's own propose and observe times, the target's packing time and the proposer's own
    stage times of every step. The first prompt is a warm-up: it runs (and fills the stream's
    memory) but is not counted."""
    replay = _Replay()
    proposer.reset_stream()
    for request, prompt in enumerate(prompts):
        for step in Decoding(target, proposer, prompt, max_new_tokens=max_new_tokens):
            iteration = step.iteration
            if iteration is None or request == 0:
                continue
            replay.add("propose", iteration.propose_s)
            replay.add("packing", target.packing_s)
            replay.add("observe", iteration.observe_s)
            for call in ("propose", "observe"):
                for part, seconds in proposer.stage_times().get(call, {}).items():
                    replay.add(part, seconds)
            replay.sizes.append(iteration.draft_size)
            replay.accepted.append(iteration.accepted)
    return replay


def _stats(seconds: Sequence[float]) -> dict[str, float]:
    values = np.asarray(seconds) * 1e3
    return {"median_ms": float(np.median(values)), "p95_ms": float(np.percentile(values, 95))}


Method = str | Callable[[], Proposer]
"""A registered method name, or a factory of a fresh proposer (one per replay)."""


def _setup(method: Method, vocab: int, budget: int, requests: int, seed: int, prompt_tokens: int,
           options: dict) -> tuple[SyntheticTarget, list[list[int]], Callable[[], Proposer]]:
    if requests < 1:
        raise ValueError("requests must be at least 1")
    target = SyntheticTarget(vocab, seed=seed, cost_profile=REPLAY_COST, pack_trees=True)
    prompts = [target.sample_prompt(prompt_tokens, seed=seed * 1_000_003 + r) for r in range(requests + 1)]
    if not isinstance(method, str):
        if options:
            raise ValueError("proposer options go with a method name, not a factory")
        return target, prompts, method
    if method in ("recap", "recap-paper"):
        options = {"budget": budget, **options}
    return target, prompts, lambda: make_proposer(method, **options)


def run_overhead(method: Method = "recap", *, vocab: int = 49152, budget: int = 63, requests: int = 8,
                 max_new_tokens: int = 128, seed: int = 0, prompt_tokens: int = 384, **proposer_options) -> dict:
    """Per-iteration host cost of ``method`` on the synthetic target, in milliseconds.

    How it is measured (time.perf_counter, the synthetic target's own work never counted):
    ``requests`` requests of one stream through `recap.decoding.Decoding`, after a warm-up
    request that is not counted; cost-aware methods get `REPLAY_COST` as the target's profile.

    - ``propose`` and ``observe``: the loop's own times of the method's real calls
      (`IterationStats`), exactly what ``decode`` reports;
    - ``packing``: `pack_tree` (ancestor matrix, packed arrays, additive mask at the request's
      real cached length), the host work a real target does before its forward;
    - sub-stages: whatever the method timed inside those calls (``Proposer.stage_times``).
      RECAP reports ``search`` (lookup, fusion and best-first search, one compiled call) and
      ``suffix`` for the paper's tree, ``candidates`` and ``choice`` for the cost-aware one,
      and ``refresh`` and ``automaton`` inside observe; other methods report none. Parts are
      timed in the same calls, so they add up to a little less than their stage (the call's
      own overhead).

    ``total`` = propose + packing + observe per iteration; its median and p95 are over
    iterations (not sums of stage medians). ``tau`` = 1 + mean accepted draft tokens.
    """
    target, prompts, build = _setup(method, vocab, budget, requests, seed, prompt_tokens, proposer_options)
    proposer = build()
    replay = _replay(proposer, target, prompts, max_new_tokens)
    if not replay.sizes:
        raise ValueError("max_new_tokens leaves no verification to time (it must be at least 2)")
    totals = np.sum([replay.times[name] for name in ("propose", "packing", "observe")], axis=0)
    return {"method": method if isinstance(method, str) else proposer.name, "vocab": vocab, "budget": budget,
            "requests": requests, "max_new_tokens": max_new_tokens, "seed": seed, "iterations": len(replay.sizes),
            "stages": {name: _stats(seconds) for name, seconds in replay.times.items()},
            "total_ms_median": float(np.median(totals) * 1e3), "total_ms_p95": float(np.percentile(totals, 95) * 1e3),
            "tau": 1.0 + float(np.mean(replay.accepted)), "mean_tree_size": float(np.mean(replay.sizes))}


def profile_overhead(method: Method = "recap", *, vocab: int = 49152, budget: int = 63, requests: int = 8,
                     max_new_tokens: int = 128, seed: int = 0, prompt_tokens: int = 384, top: int = 25,
                     sort: str = "tottime", **proposer_options) -> str:
    """cProfile of the proposer alone (enabled inside propose and observe only, warm-up included),
    as pstats text: which of the method's functions the host time goes to."""
    target, prompts, build = _setup(method, vocab, budget, requests, seed, prompt_tokens, proposer_options)
    profiler = cProfile.Profile()
    _replay(_Profiled(build(), profiler), target, prompts, max_new_tokens)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).strip_dirs().sort_stats(sort).print_stats(top)
    return out.getvalue()


_LABELS = {"propose": "propose", "search": "  search (lookup+fusion+best-first, one compiled call)",
           "suffix": "  suffix (automaton sync, continuation)", "candidates": "  candidates (search + continuations)",
           "choice": "  size choice", "packing": "packing", "observe": "observe", "refresh": "  refresh of U, C, G",
           "automaton": "  automaton, output, calibration"}


def format_overhead(result: dict) -> str:
    """A readable table of `run_overhead`'s result."""
    head = (f"{result['method']}  vocab={result['vocab']}  budget={result['budget']}  "
            f"iterations={result['iterations']}  tau={result['tau']:.2f}  "
            f"mean tree={result['mean_tree_size']:.1f} nodes")
    stages = result["stages"]
    names = [name for name in _LABELS if name in stages] + [name for name in stages if name not in _LABELS]
    width = max(18, *(len(_LABELS.get(name, name)) + 2 for name in names))
    lines = [head, f"{'stage':<{width}}{'median ms':>11}{'p95 ms':>10}"]
    for name in names:
        stats = stages[name]
        lines.append(f"{_LABELS.get(name, '  ' + name):<{width}}{stats['median_ms']:>11.4f}{stats['p95_ms']:>10.4f}")
    lines.append(f"{'total':<{width}}{result['total_ms_median']:>11.4f}{result['total_ms_p95']:>10.4f}")
    return "\n".join(lines)
