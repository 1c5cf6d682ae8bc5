"""Host-side overhead of a drafting method, without a model: what one iteration costs the CPU.

A real decode step is propose -> (device forward) -> observe, plus the host work of packing the
tree for the forward. The forward depends on the GPU; everything else is Python and numpy and
is what this module measures. `SyntheticTarget` replaces the model with a seeded numpy Markov
"language", so proposers are replayed on realistic Top-K streams (repetition, confident and
flat rows) at a real vocabulary size, and the target's own time is never counted.

Nothing here imports torch (importing the ``recap`` package itself still does, through
``recap/__init__.py``).
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
from recap.proposers import Proposer, RecapProposer, make_proposer

_MASK_MIN = np.float32(np.finfo(np.float32).min)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic): a cheap, seedable hash."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class SyntheticTarget:
    """A deterministic stand-in for the model with the duck-typed interface `recap.decoding.decode`
    uses (``prefill``, ``verify``, ``commit``, ``release``, ``eos_token_ids``, ``vocab_size``,
    ``excluded_tokens``, ``top_k``).

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
                 pair_noise: float = 2.0, window: int = 8, window_noise: float = 4.0):
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
    def prefill(self, inputs: Sequence[int] | np.ndarray) -> tuple[PromptRows, int]:
        """``inputs`` are prompt token ids. Row p is the prediction after prompt token p."""
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

    def verify(self, root: int, tree: DraftTree) -> VerifiedTree:
        """Top-K and argmax at every packed position (root = 0, node i = i + 1), each from its
        own path context (committed tail, root, then the node's ancestors)."""
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
                            accepted=tree.accept(argmax))

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
    additive (N, past_len + N) mask, as `recap.target.attention.tree_attention_mask` builds it
    (float32 here; the real target then converts to torch and copies to the device)."""
    tokens, depths = tree.packed(root)
    return tokens, depths + past_len, additive_mask(tree.ancestor_matrix(), past_len, _MASK_MIN)


REPLAY_COST = CostProfile.linear(0.06)
"""The verify-cost curve cost-aware proposers are given in the replay (t(64) ~ 4.8 t(1), as
measured for SmolLM2 fp32 on a 2-core CPU): the choice is made, its host cost counted."""


def _replay_limits(proposer: Proposer, history: Sequence[int]) -> StepLimits | None:
    return StepLimits(cost=REPLAY_COST, context_len=len(history) - 1) if getattr(proposer, "wants_cost", False) \
        else None


def _timed_propose(proposer: RecapProposer, history: Sequence[int],
                   clock: Callable[[], float]) -> tuple[DraftTree, dict[str, float]]:
    """`RecapProposer.propose` stage by stage (it is exactly these calls). With the Python
    engine, ``fused`` is wrapped on this instance during the call to time lookup + fusion; the
    numba engine does lookup, fusion and search in one compiled call, reported as ``search``."""
    if proposer.config.scored:  # cost-aware: candidates (search + continuations), then the choice
        t0 = clock()
        proposer.sync_automaton(history)
        proposer._context = list(history[-3:])
        candidates = proposer.candidates(history)
        t1 = clock()
        tree = proposer.select(candidates, _replay_limits(proposer, history))
        t2 = clock()
        return tree, {"total": t2 - t0, "candidates": t1 - t0, "choice": t2 - t1}
    fusion = 0.0
    wrapped = proposer.config.engine == "python"
    if wrapped:
        fused = proposer.fused

        def timed_fused(u: int | None, v: int | None, x: int):
            nonlocal fusion
            start = clock()
            out = fused(u, v, x)
            fusion += clock() - start
            return out

        proposer.fused = timed_fused  # type: ignore[method-assign]
    try:
        t0 = clock()
        proposer.sync_automaton(history)
        t1 = clock()
        proposer._context = list(history[-3:])
        tokens, parents, depths, _ = proposer.search(proposer._context)
        t2 = clock()
        proposer.add_suffix(tokens, parents, depths)
        t3 = clock()
        tree = DraftTree._trusted(tokens, parents, depths)
        t4 = clock()
    finally:
        if wrapped:
            del proposer.fused
    total = t4 - t0
    suffix = (t1 - t0) + (t3 - t2)
    split = {"total": total, "suffix": suffix, "search": total - fusion - suffix}
    if wrapped:
        split["fusion"] = fusion
    return tree, split


def _timed_observe(proposer: RecapProposer, step: VerifiedTree, clock: Callable[[], float]) -> dict[str, float]:
    """`RecapProposer.observe` split into the memory refresh and the rest (automaton update,
    and for cost-aware configurations the output and calibration updates)."""
    t0 = clock()
    proposer.refresh(step)
    t1 = clock()
    proposer.absorb(step)
    t2 = clock()
    return {"total": t2 - t0, "refresh": t1 - t0, "automaton": t2 - t1}


@dataclass
class _Replay:
    """Per counted iteration: stage times (seconds), trees and accepted counts."""

    times: dict[str, list[float]] = field(default_factory=dict)
    trees: list[DraftTree] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def add(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds)


def _replay(proposer: Proposer, target: SyntheticTarget, prompts: list[list[int]], max_new_tokens: int, *,
            instrument: bool = False, profiler: cProfile.Profile | None = None) -> _Replay:
    """The decode loop of `recap.decoding.decode` (greedy, no EOS), timing the host stages.
    The first prompt is a warm-up: it runs (and fills the stream's memory) but is not counted."""
    clock = time.perf_counter
    replay = _Replay()
    proposer.reset_stream()
    for request, prompt in enumerate(prompts):
        counted = request > 0
        rows, first = target.prefill(prompt)
        proposer.begin_request(rows)
        history = [*prompt, first]
        produced = 1
        while produced < max_new_tokens:
            if instrument:
                tree, split = _timed_propose(proposer, history, clock)  # type: ignore[arg-type]
            else:
                if profiler is not None:
                    profiler.enable()
                t0 = clock()
                tree = proposer.propose(history, _replay_limits(proposer, history))
                t1 = clock()
                if profiler is not None:
                    profiler.disable()
                split = {"total": t1 - t0}
            step = target.verify(history[-1], tree)
            t2 = clock()
            pack_tree(history[-1], tree, target.past_len)
            packing = clock() - t2
            committed = step.committed[: max_new_tokens - produced]
            produced += len(committed)
            if produced < max_new_tokens:
                target.commit(step.accepted)
            if instrument:
                observed = _timed_observe(proposer, step, clock)  # type: ignore[arg-type]
            else:
                if profiler is not None:
                    profiler.enable()
                t3 = clock()
                proposer.observe(step)
                t4 = clock()
                if profiler is not None:
                    profiler.disable()
                observed = {"total": t4 - t3}
            history.extend(committed)
            if counted:
                for name, seconds in split.items():
                    replay.add("propose" if name == "total" else name, seconds)
                for name, seconds in observed.items():
                    replay.add("observe" if name == "total" else name, seconds)
                replay.add("packing", packing)
                replay.trees.append(tree)
                replay.accepted.append(len(step.accepted))
        proposer.end_request()
        target.release()
    return replay


def _stats(seconds: Sequence[float]) -> dict[str, float]:
    values = np.asarray(seconds) * 1e3
    return {"median_ms": float(np.median(values)), "p95_ms": float(np.percentile(values, 95))}


def _setup(method: str, vocab: int, budget: int, requests: int, seed: int, prompt_tokens: int,
           options: dict) -> tuple[SyntheticTarget, list[list[int]], Callable[[], Proposer]]:
    if requests < 1:
        raise ValueError("requests must be at least 1")
    target = SyntheticTarget(vocab, seed=seed)
    prompts = [target.sample_prompt(prompt_tokens, seed=seed * 1_000_003 + r) for r in range(requests + 1)]
    if method in ("recap", "recap-paper"):
        options = {"budget": budget, **options}
    return target, prompts, lambda: make_proposer(method, **options)


def run_overhead(method: str = "recap", *, vocab: int = 49152, budget: int = 63, requests: int = 8,
                 max_new_tokens: int = 128, seed: int = 0, prompt_tokens: int = 384, **proposer_options) -> dict:
    """Per-iteration host cost of ``method`` on the synthetic target, in milliseconds.

    How it is measured (time.perf_counter, the synthetic target's own work never counted):

    - ``propose``, ``packing`` (`pack_tree`: ancestor matrix, packed arrays, additive mask at the
      request's real cached length) and ``observe``: an un-instrumented pass over
      ``requests`` requests of one stream, after a warm-up request that is not counted.
    - RECAP's sub-stages come from a second, instrumented pass over the same requests (same
      trajectory; every tree is checked against the first pass): ``fusion`` is the time inside
      ``RecapProposer.fused`` (lookup + fusion; ``fused`` is wrapped on the instance during that
      pass only), ``suffix`` the automaton sync + continuation + insertion, ``search`` the rest
      of propose (best-first heap, tree builder, ``DraftTree`` construction); ``refresh`` is
      ``memory.refresh`` and ``automaton`` the automaton update in observe. Each iteration's
      instrumented shares are applied to its un-instrumented propose/observe time, so sub-stages
      add up to their stage; ``instrumentation_overhead`` is how much slower the instrumented
      propose was (median ratio - 1).

    ``total`` = propose + packing + observe per iteration; its median and p95 are over
    iterations (not sums of stage medians). ``tau`` = 1 + mean accepted draft tokens.
    """
    target, prompts, build = _setup(method, vocab, budget, requests, seed, prompt_tokens, proposer_options)
    plain = _replay(build(), target, prompts, max_new_tokens)
    stages = {name: plain.times[name] for name in ("propose", "packing", "observe")}
    result: dict = {"method": method, "vocab": vocab, "budget": budget, "requests": requests,
                    "engine": getattr(getattr(build(), "config", None), "engine", None),
                    "max_new_tokens": max_new_tokens, "seed": seed, "iterations": len(plain.trees)}
    proposer = build()
    if isinstance(proposer, RecapProposer):
        instrumented = _replay(proposer, target, prompts, max_new_tokens, instrument=True)
        for i, (a, b) in enumerate(zip(plain.trees, instrumented.trees, strict=True)):
            if not (np.array_equal(a.tokens, b.tokens) and np.array_equal(a.parents, b.parents)):
                raise RuntimeError(f"instrumented pass diverged from RecapProposer.propose at iteration {i}")
        for total, parts in (("propose", ("fusion", "suffix", "search", "candidates", "choice")),
                             ("observe", ("refresh", "automaton"))):
            scale = np.asarray(plain.times[total]) / np.asarray(instrumented.times[total])
            for part in parts:
                if part in instrumented.times:
                    stages[part] = list(np.asarray(instrumented.times[part]) * scale)
        ratio = np.asarray(instrumented.times["propose"]) / np.asarray(plain.times["propose"])
        result["instrumentation_overhead"] = float(np.median(ratio) - 1.0)
    totals = np.sum([plain.times[name] for name in ("propose", "packing", "observe")], axis=0)
    result["stages"] = {name: _stats(seconds) for name, seconds in stages.items()}
    result["total_ms_median"] = float(np.median(totals) * 1e3)
    result["total_ms_p95"] = float(np.percentile(totals, 95) * 1e3)
    result["tau"] = 1.0 + float(np.mean(plain.accepted))
    result["mean_tree_size"] = float(np.mean([len(tree) for tree in plain.trees]))
    return result


def profile_overhead(method: str = "recap", *, vocab: int = 49152, budget: int = 63, requests: int = 8,
                     max_new_tokens: int = 128, seed: int = 0, prompt_tokens: int = 384, top: int = 25,
                     sort: str = "tottime", **proposer_options) -> str:
    """cProfile of the proposer alone (enabled around propose and observe only, warm-up included),
    as pstats text: which of the method's functions the host time goes to."""
    target, prompts, build = _setup(method, vocab, budget, requests, seed, prompt_tokens, proposer_options)
    profiler = cProfile.Profile()
    _replay(build(), target, prompts, max_new_tokens, profiler=profiler)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).strip_dirs().sort_stats(sort).print_stats(top)
    return out.getvalue()


_LABELS = {"propose": "propose", "fusion": "  lookup+fusion", "suffix": "  suffix", "search": "  search",
           "candidates": "  candidates (search + continuations)", "choice": "  size choice",
           "packing": "packing", "observe": "observe", "refresh": "  refresh", "automaton": "  automaton"}


def format_overhead(result: dict) -> str:
    """A readable table of `run_overhead`'s result."""
    engine = f"  engine={result['engine']}" if result.get("engine") else ""
    head = (f"{result['method']}{engine}  vocab={result['vocab']}  budget={result['budget']}  "
            f"iterations={result['iterations']}  tau={result['tau']:.2f}  "
            f"mean tree={result['mean_tree_size']:.1f} nodes")
    lines = [head, f"{'stage':<18}{'median ms':>11}{'p95 ms':>10}"]
    labels = dict(_LABELS)
    if "fusion" not in result["stages"]:
        labels["search"] = "  search (lookup+fusion+best-first, one compiled call)"
    width = max(18, *(len(label) + 2 for name, label in labels.items() if name in result["stages"]))
    lines[-1] = f"{'stage':<{width}}{'median ms':>11}{'p95 ms':>10}"
    for name in labels:
        if name in result["stages"]:
            stats = result["stages"][name]
            lines.append(f"{labels[name]:<{width}}{stats['median_ms']:>11.4f}{stats['p95_ms']:>10.4f}")
    lines.append(f"{'total':<{width}}{result['total_ms_median']:>11.4f}{result['total_ms_p95']:>10.4f}")
    if "instrumentation_overhead" in result:
        lines.append(f"(sub-stages from an instrumented pass, {result['instrumentation_overhead']:+.0%} "
                     "slower, rescaled to the plain stage times)")
    return "\n".join(lines)
