"""Measuring, caching and choosing a target's verify-cost profile (`recap.core.cost`).

A profile is only valid for what it was measured on: model, dtype, thread count, device,
CPU and library versions form its key, and the key's hash names the cache file
(``cache_dir()/profiles/<hash>.json``). A missing profile is measured once (the quick
variant, ~10-15 s on SmolLM2 with one CPU thread); a corrupt or stale one is reported on
one line and measured again: a bad cache file must never stop a generation.

Timings follow what one decode step pays: ``verify(root, tree)`` plus ``commit([])`` after a
synthetic prompt of L tokens, in a measuring session the target provides
(`measuring`): it restores its cache after every measurement, so each one sees
the same context length, and the profiler never edits the target's state itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from recap.core.cost import DEFAULT_SIZES, PROFILE_VERSION, CostProfile, ProfileError
from recap.core.tree import ROOT, DraftTree
from recap.errors import InputError
from recap.machine import cpu_model
from recap.paths import cache_dir
from recap.verifier.inputs import ModelInputs
from recap.verifier.kernels import KERNELS_REVISION, linear
from recap.verifier.kernels.linear import ROW_BLOCK
from recap.verifier.kernels.threads import check_read_back, read_back

if TYPE_CHECKING:
    from recap.verifier.base import TargetModel

DEFAULT_CONTEXTS = (128, 1024)
"""Context lengths measured: two, so the growth of t(N) with the cached prefix is known."""
QUICK_SIZES = (1, 2, 4, 8, 16, 32, 64)
FAST_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 17, 24, 25, 32, 33, 48, 49, 64, 96, 128)
FAST_QUICK_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 17, 32, 33, 64)
"""On the fast kernels a step's cost jumps at each row block (1-4 packed tokens run as 4
rows, 5-8 as 8, ...; on 3x4 machines 4k + 1 and 4k + 2 rows cost less than the whole block,
`FastDecoder.row_block`): every size up to 10 and both sides of the larger block
boundaries, so interpolation does not smooth the steps where drafts are usually chosen."""
"""Beyond 64 the profile extrapolates the 32-64 slope."""
REPEATS = 4
QUICK_REPEATS = 3

Progress = Callable[[int, int], None]
"""``progress(done, total)`` after every timed verification."""


# --------------------------------------------------------------------------- keys and files
@functools.cache
def _cpu_model() -> str:
    return cpu_model()


def profile_key(target: TargetModel) -> dict:
    """What a verify time depends on besides the tree: a profile measured under another key
    does not describe this target."""
    import transformers

    device = target.device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return {"model": target.name, "params": target.parameter_count,
            "dtype": str(target.dtype).removeprefix("torch."),
            "kernels": target.kernels, "threads": torch.get_num_threads(),
            "kernels_revision": KERNELS_REVISION if target.kernels == "fast" else 0,
            "linear_block": f"{linear.WEIGHT_ROWS}x{ROW_BLOCK}" if target.kernels == "fast" else "",
            "weights": target.weights,
            "device": str(device), "gpu": gpu, "cpu": _cpu_model(), "torch": torch.__version__,
            "transformers": transformers.__version__, "version": PROFILE_VERSION}


def profile_path(key: dict) -> Path:
    """The cache file for ``key``: equal keys, equal path."""
    canonical = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return cache_dir() / "profiles" / f"{hashlib.sha256(canonical.encode()).hexdigest()[:16]}.json"


def read_profile(path: str | os.PathLike) -> CostProfile:
    """A profile file; `ProfileError` when it is not one, OSError when it cannot be read."""
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError:
        raise ProfileError("cost profile is not text") from None
    profile = CostProfile.from_json(text)
    if profile.key.get("kernels") == "fast" and "row_block" not in json.loads(text):  # saved before the field
        profile = dataclasses.replace(profile, row_block=ROW_BLOCK)
    return profile


def save_profile(profile: CostProfile, path: str | os.PathLike) -> Path:
    """Write atomically (temp file + rename): a concurrent reader sees the old file or the new."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as stream:
            stream.write(profile.to_json())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return path


def key_differences(stored: dict, key: dict) -> list[str]:
    """``field stored -> current`` for every field that differs."""
    return [f"{name} {stored.get(name)!r} -> {key.get(name)!r}" for name in sorted(set(stored) | set(key))
            if stored.get(name) != key.get(name)]


def _say(message: str) -> None:
    print(f"recap: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- measurement
def random_tree(nodes: int, pool: np.ndarray, rng: np.random.Generator) -> DraftTree:
    """A bushy tree: every node's parent is drawn among the root and earlier nodes."""
    parents = [ROOT if i == 0 else int(rng.integers(ROOT, i)) for i in range(nodes)]
    return DraftTree(rng.choice(pool, nodes), parents)


def _token_pool(target: TargetModel) -> np.ndarray:
    """Ordinary token ids: no special tokens, no image placeholders (they need pixels)."""
    vocab = target.vocab_size
    with contextlib.suppress(TypeError):  # a tokenizer without len(): trust the config
        vocab = min(vocab, len(target.tokenizer))
    banned = set(target.excluded_tokens) | set(getattr(target.tokenizer, "all_special_ids", []) or [])
    ids = np.arange(vocab, dtype=np.int64)
    return ids[~np.isin(ids, np.fromiter(banned, dtype=np.int64, count=len(banned)))]


def _fit(target: TargetModel, sizes: Sequence[int], contexts: Sequence[int]) -> tuple[list[int], list[int]]:
    """Sizes and contexts clamped so that context + size stays inside the position range and
    the sliding window (beyond it the tree mask would not match the model's attention)."""
    limit = target.max_context
    if target.sliding_window:
        limit = min(limit, target.sliding_window)
    fitting = sorted({int(n) for n in sizes if 1 <= n <= limit - 1})
    if not fitting:
        raise InputError(f"{target.name} holds {limit} positions: too few to measure verification")
    room = limit - fitting[-1]
    clamped = sorted({max(1, min(int(c), room)) for c in contexts})
    return fitting, clamped


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_step(session: MeasuringSession, tree: DraftTree, device: torch.device) -> float:
    """Seconds of one decode step's target work (verify + commit of the root only); the
    session then restores the prompt's cache (untimed), so every step sees the same context."""
    _synchronize(device)
    start = time.perf_counter()
    session.step(tree)
    _synchronize(device)
    elapsed = time.perf_counter() - start
    session.restore()
    return elapsed


def measure_times(target: TargetModel, sizes: Sequence[int], contexts: Sequence[int], repeats: int, *,
                  seed: int = 0, warmup: bool = True, progress: Progress | None = None) -> np.ndarray:
    """Median seconds ``times[c, s]`` of verify + commit for ``sizes[s]`` packed tokens (root
    included) after ``contexts[c]`` cached tokens; sizes are timed in a fresh random order
    every round so drift spreads evenly. Each context is one measuring session of the target
    (`TargetModel.measuring`: stock attention path, cache freed at the end)."""
    if repeats < 1:
        raise InputError(f"repeats must be at least 1, got {repeats}")
    rng = np.random.default_rng(seed)
    pool = _token_pool(target)
    trees = {n: random_tree(n - 1, pool, rng) for n in sizes}
    times = np.zeros((len(contexts), len(sizes)))
    total, done = len(contexts) * len(sizes) * repeats, 0
    device = target.device
    for c, context in enumerate(contexts):
        with measuring(target, rng.choice(pool, context)) as session:
            if warmup and c == 0:  # first calls pay for allocations and kernel selection
                for n in dict.fromkeys((sizes[0], sizes[len(sizes) // 2], sizes[-1])):
                    _time_step(session, trees[n], device)
            samples: dict[int, list[float]] = {n: [] for n in sizes}
            gc.collect()
            for _ in range(repeats):
                for n in rng.permutation(sizes).tolist():
                    samples[n].append(_time_step(session, trees[n], device))
                    done += 1
                    if progress is not None:
                        progress(done, total)
        times[c] = [statistics.median(samples[n]) for n in sizes]
    return times


def measure_profile(target: TargetModel, sizes: Sequence[int] | None = None,
                    contexts: Sequence[int] = DEFAULT_CONTEXTS, repeats: int | None = None, *,
                    quick: bool = False, progress: Progress | None = None, seed: int = 0) -> CostProfile:
    """Measure this target's verify-cost grid now. ``quick`` (the lazy path) takes fewer
    sizes and repeats; explicit ``sizes`` / ``repeats`` win. Uses the caller's thread count,
    and refuses (`RecapError`) a measurement whose threads, read back after it, differ from
    the count its key records."""
    if sizes is None:
        fast = target.kernels == "fast"
        sizes = (FAST_QUICK_SIZES if fast else QUICK_SIZES) if quick else (FAST_SIZES if fast else DEFAULT_SIZES)
    repeats = (QUICK_REPEATS if quick else REPEATS) if repeats is None else repeats
    fitted_sizes, fitted_contexts = _fit(target, sizes, contexts)
    key = profile_key(target)
    times = measure_times(target, fitted_sizes, fitted_contexts, repeats, seed=seed, progress=progress)
    # what ran, not what was asked: a profile keyed 1 thread must have timed 1 thread
    check_read_back(key["threads"], read_back(target.kernels), f"the cost profile of {target.name}")
    return CostProfile(sizes=fitted_sizes, contexts=fitted_contexts, times=times, key=key,
                       source="measured", row_block=target.cost_row_block)


# --------------------------------------------------------------------------- choosing a profile
def load_or_measure(target: TargetModel, *, quiet: bool = False) -> CostProfile:
    """The cached profile for this target's key, or a quick measurement saved for next time.
    A corrupt or stale cache file costs one warning line and a remeasurement, never a crash;
    ``quiet`` prints nothing at all."""
    say = (lambda _message: None) if quiet else _say
    key = profile_key(target)
    path = profile_path(key)
    problem = None
    try:
        profile = read_profile(path)
    except FileNotFoundError:
        pass
    except (ProfileError, OSError) as error:
        problem = f"is unusable ({_one_line(error)})"
    else:
        if profile.key == key:
            return profile
        problem = f"was measured for other settings ({'; '.join(key_differences(profile.key, key))})"
    if problem:
        say(f"warning: cached cost profile {path} {problem}; measuring again")
    else:
        say(f"note: measuring the verify cost of {target.name} on this machine once (cached in {path.parent})")
    profile = measure_profile(target, quick=True)
    try:
        save_profile(profile, path)
    except OSError as error:
        say(f"warning: could not cache the cost profile at {path} ({_one_line(error)})")
    return profile


def resolve_profile(target: TargetModel, spec: str | os.PathLike | CostProfile | None) -> CostProfile:
    """``None``/``"auto"``: cached or measured (corrected online by the run's own verify
    times); ``"flat"``: free verification (the paper's setting); a profile: itself;
    otherwise a profile file, used as given: never corrected online, so drafting choices do
    not depend on this run's timing (A/B comparisons of tau, another machine simulated). A
    file measured under another key is used with a warning: it may deliberately simulate
    another machine."""
    if isinstance(spec, CostProfile):
        return spec
    if spec is None or spec == "auto":
        return load_or_measure(target)
    if spec == "flat":
        return CostProfile.flat()
    path = Path(spec)
    try:
        profile = read_profile(path)
    except FileNotFoundError:
        raise InputError(f"cost profile {path} does not exist (use auto, flat or a file from `recap calibrate`)") \
            from None
    except (ProfileError, OSError) as error:
        raise InputError(f"cost profile {path} is unusable: {_one_line(error)}") from None
    differences = key_differences(profile.key, profile_key(target))
    if differences:
        _say(f"warning: cost profile {path} was measured for other settings ({'; '.join(differences)}); using it")
    return dataclasses.replace(profile, source="file", correction_rate=0.0)


def _one_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


@dataclass
class MeasuringSession:
    """Decode steps over a fixed prefix (`measuring`): each ``step`` is what one
    decode step pays the target, ``restore`` puts the cache back to the prefix, outside the
    timed part."""

    target: TargetModel
    root: int
    """The token after the prefix (prefill's first token): every step's root."""
    context_len: int
    """Tokens cached before every step."""

    def step(self, tree: DraftTree) -> None:
        """``verify(root, tree)`` then ``commit([])`` (the root's KV entry is kept, as in decoding)."""
        if self.target.past_len != self.context_len:
            raise RuntimeError("restore() the session before the next step")
        self.target.verify(self.root, tree)
        self.target.commit([])

    def restore(self) -> None:
        """Back to ``context_len`` cached tokens, so every step sees the same context."""
        self.target.lane.truncate(self.context_len)


@contextlib.contextmanager
def measuring(target: TargetModel, prompt: Sequence[int] | np.ndarray) -> Iterator[MeasuringSession]:
    """A session for timing decode steps after ``prompt`` (token ids, no image): its KV cache is
    prefilled, image-attention capture is off (the stock attention path is what is timed), and
    on leaving the cache is freed and the capture restored. The cache is the target's own
    business: the profiler only calls the session's ``step`` and ``restore``."""
    capturing = target.capture is not None and target.capture.enabled
    target.capture_image_attention(False)
    try:
        ids = torch.from_numpy(np.asarray(prompt, dtype=np.int64).reshape(1, -1))
        _, root = target.prefill(ModelInputs(input_ids=ids))
        yield MeasuringSession(target, root, target.past_len)
    finally:
        target.release()
        if capturing:
            target.capture_image_attention(True)
