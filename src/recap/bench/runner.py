"""Paired benchmark runs: every unit through AR and every method, in one process, resumable.

Per unit (one turn of one input): the chat messages and image are prepared once, untimed;
then AR and every method decode them in an order rotated per unit (seeded), each method on
its own stream; every output is compared with AR's token for token. The rows of the unit
go to results.jsonl in one write, then the streams are checkpointed (`recap.bench.streams`).
Before the first unit every method decodes the first unit once (warm-up: kernels, numba,
caches; not recorded), and streams start fresh at every topic. With ``repeats`` > 1 every
method decodes the unit that many times, in rounds (`REPEATS`), and its row is the round of
median time: one slow moment of a noisy host then decides no unit's ratio.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from recap.bench import calibration
from recap.bench import data as bench_data
from recap.bench.compiles import CompileWatch
from recap.bench.environment import machine, versions
from recap.bench.metrics import FLOAT_REFERENCE, REFERENCE, STOCK_REFERENCE, first_difference, unit_tau
from recap.bench.results import ResultsFile, check_settings, interrupts_held, write_json_atomic
from recap.bench.sources import resolve_data
from recap.bench.streams import MethodSpec, StreamCheckpoints, is_stateful, parse_methods
from recap.decoding import GenerationResult, decode
from recap.errors import InputError
from recap.images import load_image
from recap.verifier import TargetModel
from recap.verifier.kernels.threads import check_read_back, read_back

DEFAULT_METHODS = ("recap", "recap-paper", "pld", "sam")
"""Compared with AR by default, those of them that are registered."""

ROTATION = ("cyclic: the method list [ar, methods...] starts at offset sha256(f'{seed}:{unit}') mod its length, "
            "so each method leads equally often on average and the order is reproducible per unit")
WARMUP_TOKENS = 16
WARMUP = (f"every method (AR included) decodes the first unit once (at most {WARMUP_TOKENS} new tokens) before "
          "timing; not recorded; streams then start fresh")
REPEATS = ("each unit is decoded in {n} rounds, every round through AR and every method in its own rotated order; "
           "rounds after the first decode a copy of each method's stream and prefix cache as they stood before "
           "the unit (the first round's stream is the one carried on); a row is its method's round of median "
           "time (the lower middle of an even count), every round's output compared with AR's")


@dataclass
class BenchConfig:
    model: str = "smollm2-135m"
    methods: str | None = None
    """Comma-separated method specs (``recap,pld,recap:budget=16``); AR always runs."""
    data: str | None = None
    topics: Sequence[str] | None = None
    limit: int | None = None
    """Inputs per topic (a multi-turn input is several units)."""
    dtype: str = "float32"
    device: str = "cpu"
    """Torch device of the target (``cuda``...); recorded in the settings when not the CPU."""
    threads: int = 1
    max_new_tokens: int = 200
    repeats: int = 1
    """Timed decodes of every (unit, method), in rounds; a row keeps its median-time round (`REPEATS`)."""
    seed: int = 0
    out: Path = Path("bench-out")
    warmup: bool = True
    system_prompt: str = bench_data.MMSPEC_SYSTEM_PROMPT
    cost_profile: str | None = None
    """Verify-cost profile for cost-aware methods: ``auto`` (or None: the target's own,
    cached or measured once), ``flat`` or a profile file (`recap calibrate --out`)."""
    temperature: float | None = None
    """> 0: sample (with ``top_k``, ``top_p``); each unit's seed is shared by every method,
    so their outputs are still identical token for token (`recap.verifier.sampling`)."""
    top_k: int | None = None
    top_p: float | None = None
    kernels: str = "auto"
    """The target's decode-step path (`TargetModel.use_kernels`) for every method."""
    weights: str = "auto"
    """What the fast steps read (`TargetModel.weights`: GGUF blocks as stored, or floats)."""
    reference: str | None = None
    """``stock``: also run plain AR on stock transformers (``ar-stock``), paired in the run,
    compared with AR for agreement only (on fast kernels near-ties may differ)."""

    def sampling(self, unit_key: str):
        """The unit's sampling settings (None: greedy)."""
        from recap.verifier.sampling import Sampling

        seed = int.from_bytes(hashlib.sha256(f"{self.seed}:sample:{unit_key}".encode()).digest()[:7], "big")
        return Sampling.of(self.temperature, self.top_k, self.top_p, seed)


@dataclass
class BenchRun:
    """What a finished (or interrupted) session leaves behind."""

    out: Path
    rows: list[dict]
    units_total: int
    units_run: int
    interrupted: bool = False
    summary: dict | None = None
    files: list[Path] = field(default_factory=list)


def default_methods() -> str:
    from recap.proposers import PROPOSERS

    return ",".join(name for name in DEFAULT_METHODS if name in PROPOSERS)


def rotation(labels: Sequence[str], seed: int, unit_key: str) -> list[str]:
    """The order in which a unit's methods run: a seeded, per-unit cyclic shift."""
    digest = hashlib.sha256(f"{seed}:{unit_key}".encode()).digest()
    offset = int.from_bytes(digest[:8], "big") % len(labels)
    return [*labels[offset:], *labels[:offset]]


def latest_rows(rows: Sequence[dict]) -> dict[tuple[str, str], dict]:
    """(unit, method) -> row; a later row for the same pair (a rerun unit) wins."""
    return {(row["unit"], row["method"]): row for row in rows}


def _row(unit: bench_data.Unit, label: str, position: int, result: GenerationResult, reference: list[int],
         has_image: bool, stream: str) -> dict:
    iterations = result.iterations
    accepted = sum(it.accepted for it in iterations)
    difference = first_difference(result.tokens, reference)
    return {
        "unit": unit.key, "item": unit.item.id, "turn": unit.turn, "topic": unit.topic, "method": label,
        "position": position, "n_tokens": len(result.tokens), "time_s": result.total_s,
        "prefill_s": result.prefill_s, "propose_s": sum(it.propose_s for it in iterations),
        "verify_s": sum(it.verify_s for it in iterations), "observe_s": sum(it.observe_s for it in iterations),
        "iterations": len(iterations), "accepted": accepted, "draft_nodes": sum(it.draft_size for it in iterations),
        "tau": unit_tau(accepted, len(iterations)), "tokens_per_s": result.tokens_per_s,
        "stop_reason": result.stop_reason, "prompt_tokens": result.prompt_len, "has_image": has_image,
        "identical": difference is None, "first_difference": difference, "stream": stream, "tokens": result.tokens,
    }


class Bench:
    """One benchmark session over an output folder (new or being resumed)."""

    def __init__(self, config: BenchConfig, target: TargetModel | None = None, console=None, progress: bool = True):
        self.config = config
        self.console = console
        self.show_progress = progress
        self.specs: list[MethodSpec] = parse_methods(config.methods, tuple(default_methods().split(",")))
        references = [] if config.reference is None else config.reference.split(",")
        if not set(references) <= {"stock", "float"}:
            raise InputError(f"--reference takes stock, float or stock,float; got {config.reference!r}")
        if "float" in references:
            self.specs.insert(1, MethodSpec(FLOAT_REFERENCE, "ar", weights="float"))
        if "stock" in references:
            self.specs.insert(1, MethodSpec(STOCK_REFERENCE, "ar", kernels="stock"))
        self.labels = [spec.label for spec in self.specs]
        if config.max_new_tokens < 1:
            raise InputError(f"--max-new-tokens must be at least 1, got {config.max_new_tokens}")
        if config.limit is not None and config.limit < 1:
            raise InputError(f"--limit must be at least 1, got {config.limit}")
        if config.repeats < 1:
            raise InputError(f"--repeats must be at least 1, got {config.repeats}")
        self.data_path = resolve_data(config.data)
        self.items = bench_data.select(bench_data.load_items(self.data_path), config.topics, config.limit)
        self.units = bench_data.units_of(self.items)
        self.out = Path(config.out)
        self.results = ResultsFile(self.out)
        self.target = target
        self.images = None

    # ----------------------------------------------------------------- settings
    def settings(self) -> dict:
        """What a resume must share with the run it continues."""
        return {"model": self.config.model, "dtype": self.config.dtype, "threads": self.config.threads,
                "max_new_tokens": self.config.max_new_tokens, "seed": self.config.seed, "methods": self.labels,
                "data": str(self.data_path), "system_prompt": self.config.system_prompt,
                "cpu": machine()["cpu"], "warmup": self.config.warmup, "cost_profile": self._cost_spec(),
                **({"device": self.config.device} if self.config.device != "cpu" else {}),
                **({"repeats": self.config.repeats} if self.config.repeats != 1 else {}),
                **({"kernels": self.config.kernels} if self.config.kernels != "auto" else {}),
                **({"weights": self.config.weights} if self.config.weights != "auto" else {}),
                **({"sampling": {"temperature": self.config.temperature, "top_k": self.config.top_k,
                                 "top_p": self.config.top_p}} if self.config.temperature else {})}

    def _cost_spec(self) -> str | None:
        """The --cost-profile setting; None for auto (so runs recorded before it resume)."""
        spec = self.config.cost_profile
        return None if spec is None or spec == "auto" else str(spec)

    def _load_target(self) -> TargetModel:
        if self.target is None:
            from recap.models import load

            self.target = load(self.config.model, dtype=self.config.dtype, device=self.config.device,
                               kernels=self.config.kernels, weights=self.config.weights)
        else:
            self.target.use_kernels(self.config.kernels)
        self.kernels = self.target.kernels
        return self.target

    @contextlib.contextmanager
    def _kernels_for(self, spec: MethodSpec):
        """The target on ``spec``'s step path and weights for one decode (untimed switch), then back."""
        if spec.weights is not None and spec.weights != self.target.weights:
            weights = self.target.weights
            if self.target.use_weights(spec.weights) != spec.weights:
                raise InputError(f"method {spec.label}: the target cannot read {spec.weights} weights "
                                 f"on {self.target.kernels} kernels")
            try:
                yield
            finally:
                self.target.use_weights(weights)
            return
        if spec.kernels is None or spec.kernels == self.kernels:
            yield
            return
        self.target.use_kernels(spec.kernels)
        try:
            yield
        finally:
            self.target.use_kernels(self.kernels)

    # ----------------------------------------------------------------- run
    def run(self) -> BenchRun:
        self.out.mkdir(parents=True, exist_ok=True)
        rows = self.results.load()
        record = check_settings(self.out, self.settings(), bool(rows))
        if not rows:  # a new run: no stream checkpoint of an earlier one may be picked up
            shutil.rmtree(self.out / "streams", ignore_errors=True)
        torch.set_num_threads(self.config.threads)
        target = self._load_target()
        if self._cost_spec() is not None:
            target.use_cost_profile(self._cost_spec())
        self.images = bool(target.accepts_images)
        if self.images:
            bench_data.check_images(self.items)
        done = latest_rows(rows)
        pending = [u for u in self.units if not all((u.key, label) in done for label in self.labels)]
        session = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "kernels": target.kernels,
                   "weights": target.weights,
                   "units_done_before": len(self.units) - len(pending), "units_selected": len(self.units),
                   "machine": machine(), "versions": versions(), "threads": self.config.threads,
                   "stream_events": []}
        record.setdefault("sessions", []).append(session)
        record["images_used"] = self.images
        write_json_atomic(self.out / "run.json", record)
        run = BenchRun(self.out, rows, len(self.units), 0)
        started = time.perf_counter()
        try:
            if pending:
                with self._progress(len(pending)) as advance:
                    if self.config.warmup:
                        self._warm_up(advance)
                    self._check_threads(target, session)  # before the first row is written
                    self._run_units(pending, done, rows, session, advance, run)
                self._check_threads(target, session)
        except KeyboardInterrupt:
            run.interrupted = True
        finally:
            session["wall_s"] = time.perf_counter() - started
            session["units_run"] = run.units_run
            session["interrupted"] = run.interrupted
            write_json_atomic(self.out / "run.json", record)
        run.rows = rows
        return run

    def _check_threads(self, target, session: dict) -> None:
        """Record the thread counts read back (torch's, the fast kernels'), and refuse a run
        whose counts differ from ``--threads``: its times would be labelled wrongly."""
        session["threads_ran"] = read_back(target.kernels)
        check_read_back(self.config.threads, session["threads_ran"], "this bench run")

    @contextlib.contextmanager
    def _progress(self, units: int):
        """A rich progress bar over (unit, method) decodes; ``advance(text)`` moves it."""
        if not self.show_progress:
            yield lambda *_args, **_kw: None
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("eta"), TimeRemainingColumn())
        # Two refreshes a second: the bar's thread should not compete with the timed decodes.
        with Progress(*columns, console=self.console, transient=False, refresh_per_second=2) as progress:
            total = units * len(self.labels) * self.config.repeats + (len(self.labels) if self.config.warmup else 0)
            task = progress.add_task("bench", total=total)

            def advance(text: str, step: int = 1) -> None:
                progress.update(task, description=text, advance=step)

            yield advance

    def _prepare(self, unit: bench_data.Unit, answers: Sequence[str]):
        """Model inputs of a unit: data loading and tokenisation, never timed."""
        messages = bench_data.messages_for(unit, answers, self.config.system_prompt)
        image = load_image(unit.item.image) if self.images and unit.item.image is not None else None
        return self.target.prepare(messages, image), image is not None

    def _warm_up(self, advance) -> None:
        inputs, _ = self._prepare(self.units[0], [])
        for spec in self.specs:
            advance(f"warm-up {spec.label}", 0)
            with self._kernels_for(spec):
                decode(self.target, spec.make(), inputs, max_new_tokens=min(self.config.max_new_tokens, WARMUP_TOKENS))
            advance(f"warm-up {spec.label}")

    def _run_units(self, pending, done, rows, session, advance, run: BenchRun) -> None:
        pending_keys = {u.key for u in pending}
        answers: dict[str, list[str]] = {}
        for topic in dict.fromkeys(u.topic for u in self.units):
            topic_units = [u for u in self.units if u.topic == topic]
            if not any(u.key in pending_keys for u in topic_units):
                continue
            checkpoints = StreamCheckpoints(self.out, topic)
            streams = {spec.label: spec.make() for spec in self.specs}  # fresh streams at every topic
            status = {label: "fresh" for label in self.labels}
            finished = [u for u in topic_units if u.key not in pending_keys]
            if finished:  # resuming inside this topic
                for label in self.labels:
                    last = [u.key for u in topic_units if (u.key, label) in done and u.key not in pending_keys]
                    state = checkpoints.restore(label, streams[label], last[-1]) if last else "fresh"
                    status[label] = state
                    if state in ("restored", "restarted"):
                        session["stream_events"].append({"topic": topic, "method": label, "event": state,
                                                         "after_unit": last[-1]})
            for unit in topic_units:
                if unit.key not in pending_keys:
                    if unit.turn + 1 < len(unit.item.turns):
                        answers.setdefault(unit.item.id, []).append(done[(unit.key, REFERENCE)]["text"])
                    continue
                new_rows = self._run_unit(unit, answers.get(unit.item.id, []), streams, status, advance)
                answers.setdefault(unit.item.id, []).append(new_rows[0]["text"])
                with interrupts_held():
                    self.results.append(new_rows)
                    rows.extend(new_rows)
                    checkpoints.save(streams, unit.key)
                run.units_run += 1
                for label in self.labels:
                    status[label] = "carried"

    def _run_unit(self, unit, answers, streams, status, advance) -> list[dict]:
        inputs, has_image = self._prepare(unit, answers)
        repeats = self.config.repeats
        # later rounds start where the first did: copies of the streams and of the prefix cache (untimed)
        starts = {label: copy.deepcopy(streams[label]) for label in self.labels} if repeats > 1 else {}
        cache = self.target.prefix_cache
        cache_before = cache.copy() if repeats > 1 and cache is not None else None
        rounds: list[dict[str, GenerationResult]] = []
        learned: dict[str, dict] = {}  # what the carried stream's (first) round taught its calibrator
        compiled: list[dict[str, dict]] = []  # per round: numba compiles inside each timed decode
        order = rotation(self.labels, self.config.seed, unit.key)
        for round_index in range(repeats):
            stamp = "" if repeats == 1 else f" ({round_index + 1}/{repeats})"
            round_order = order if round_index == 0 else \
                rotation(self.labels, self.config.seed, f"{unit.key}#round{round_index}")
            results, compiles = {}, {}
            for label in round_order:
                advance(f"{unit.topic} {unit.key} [bold]{label}[/]{stamp}", 0)
                stream = streams[label] if round_index == 0 else copy.deepcopy(starts[label])
                if round_index and cache_before is not None:
                    self.target.prefix_cache = cache_before.copy()
                before = calibration.snapshot(stream)
                results[label], compiles[label] = self._decode(label, stream, inputs, unit.key)
                if round_index == 0:
                    learned[label] = calibration.unit_fields(stream, before)  # untimed
                advance(f"{unit.topic} {unit.key} [bold]{label}[/]{stamp}")
            if round_index == 0:
                cache_after = self.target.prefix_cache
            rounds.append(results)
            compiled.append(compiles)
        if repeats > 1 and cache_before is not None:
            self.target.prefix_cache = cache_after  # as a single round would have left it
        reference = rounds[0][REFERENCE].tokens
        new_rows = []
        for label in self.labels:
            stream = status[label] if is_stateful(streams[label]) else "none"
            times = [results[label].total_s for results in rounds]
            chosen = sorted(range(repeats), key=times.__getitem__)[(repeats - 1) // 2]
            row = _row(unit, label, order.index(label), rounds[chosen][label], reference, has_image, stream)
            for results in rounds:  # every round's output, not only the one kept
                difference = first_difference(results[label].tokens, reference)
                if difference is not None and row["identical"]:
                    row["identical"], row["first_difference"] = False, difference
            if repeats > 1:
                row["round_times_s"], row["round_kept"] = times, chosen
            new_rows.append({**row, **learned[label], **compiled[chosen][label]})
        new_rows[0]["text"] = self.target.tokenizer.decode(reference, skip_special_tokens=True).strip()
        return new_rows

    def _decode(self, label: str, stream, inputs, unit_key: str) -> tuple[GenerationResult, dict]:
        """One timed decode of a unit by ``label``'s ``stream``, and the numba compiles inside it
        (row fields, `recap.bench.compiles`)."""
        gc.collect()  # untimed: keep collector pauses out of the timed decode
        # each method reuses only its own earlier prompts' prefixes (as its own server would):
        # a later method must not get the unit's prefill for free from an earlier one
        self.target.prefix_scope = label
        spec = next(spec for spec in self.specs if spec.label == label)
        with self._kernels_for(spec), CompileWatch() as compiles:
            result = decode(self.target, stream, inputs, max_new_tokens=self.config.max_new_tokens,
                            sampling=self.config.sampling(unit_key))
        return result, compiles.fields()


def run_record(out: Path) -> dict:
    """The run.json of an output folder."""
    import json

    return json.loads((Path(out) / "run.json").read_text())
