"""Methods as the bench runs them: names with options, one stream per (method, topic), and
stream checkpoints that let an interrupted run resume without silently going cold.

A method spec is a registered proposer name with optional ``:key=value`` options, e.g.
``recap`` or ``recap:budget=16`` (the spec is the method's label in every output).

Streams follow the paper: a fresh proposer object per method and topic (persistent memory
such as RECAP's U starts empty at every topic and is carried across that topic's inputs;
each method has its own object, so nothing is shared). Resume: after every finished unit
the stream of each *stateful* method (one that overrides ``reset_stream``) is saved with
its ``save_memory`` when it has one (RECAP: U, the whole persistent state). On resume it is
restored from that file (``restored``: RECAP's file keeps probabilities in float32, so near
ties may draft differently from an uninterrupted run; outputs are unaffected). A stateful
method without ``save_memory`` restarts cold at the resume point (``restarted``), and the
report lists every such event.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from recap.errors import InputError
from recap.proposers import PROPOSERS, BaseProposer, Proposer, make_proposer

NOT_BENCHABLE = frozenset({"decoy", "random"})
"""Adversarial test drafters: they exist to stress verification, not to be timed."""


@dataclass(frozen=True)
class MethodSpec:
    label: str
    name: str
    options: dict = field(default_factory=dict)
    kernels: str | None = None
    """The target's step path for this method (``stock`` for ar-stock); None: the run's."""
    weights: str | None = None
    """What the fast steps read for this method (``float`` for ar-float); None: the run's."""

    def make(self) -> Proposer:
        try:
            return make_proposer(self.name, **self.options)
        except TypeError as error:
            raise InputError(f"method {self.label!r}: bad option ({error})") from None


def _value(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_methods(text: str | None, default: tuple[str, ...]) -> list[MethodSpec]:
    """``ar`` first (the reference, always run), then the requested methods in order.
    Names are checked against `PROPOSERS` now, so other methods can register later."""
    labels = [m.strip() for m in (text.split(",") if text else default) if m.strip()]
    specs = [MethodSpec("ar", "ar")]
    allowed = [name for name in PROPOSERS if name not in NOT_BENCHABLE]
    for label in labels:
        name, *parts = label.split(":")
        if name not in PROPOSERS or name in NOT_BENCHABLE:
            raise InputError(f"unknown method {name!r} for --methods; choose from: {', '.join(allowed)}")
        options = {}
        for part in parts:
            key, eq, value = part.partition("=")
            if not eq or not key.isidentifier():
                raise InputError(f"method {label!r}: options look like {name}:key=value, got {part!r}")
            options[key] = _value(value)
        if name == "ar":
            if options:
                raise InputError("ar takes no options")
            continue
        if label in (s.label for s in specs):
            raise InputError(f"method {label!r} is listed twice")
        specs.append(MethodSpec(label, name, options))
    if len(specs) == 1:
        raise InputError("--methods lists no method to compare with ar")
    for spec in specs[1:]:
        spec.make()  # bad options fail here, before any model time is spent
    return specs


def is_stateful(proposer: Proposer) -> bool:
    """Whether a proposer keeps state across requests: its ``stream_state`` flag, or, for
    proposers that do not say, whether it overrides ``reset_stream``."""
    flag = getattr(proposer, "stream_state", None)
    if flag is not None:
        return bool(flag)
    return getattr(type(proposer), "reset_stream", None) is not BaseProposer.reset_stream


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", text).strip("_") or "_"


class StreamCheckpoints:
    """Per topic and method, the stream state after the last finished unit."""

    def __init__(self, out: Path, topic: str):
        self.folder = Path(out) / "streams" / _slug(topic)
        self.index_path = self.folder / "index.json"

    def _index(self) -> dict:
        try:
            return json.loads(self.index_path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def save(self, streams: dict[str, Proposer], unit_key: str) -> None:
        """Save every checkpointable stateful stream as it stands after ``unit_key``."""
        from recap.bench.results import write_json_atomic

        index = self._index()
        for label, proposer in streams.items():
            if is_stateful(proposer) and hasattr(proposer, "save_memory") and hasattr(proposer, "load_memory"):
                self.folder.mkdir(parents=True, exist_ok=True)
                name = f"{_slug(label)}.safetensors"
                proposer.save_memory(self.folder / name)
                index[label] = {"after_unit": unit_key, "file": name}
        if index:
            write_json_atomic(self.index_path, index)

    def restore(self, label: str, proposer: Proposer, last_unit: str) -> str:
        """Bring a fresh ``proposer`` to where its stream stood after ``last_unit``.
        Returns ``restored``, ``restarted`` (no usable checkpoint: cold from here) or
        ``none`` (a stateless method, nothing to restore)."""
        if not is_stateful(proposer):
            return "none"
        entry = self._index().get(label)
        if not entry or entry.get("after_unit") != last_unit or not hasattr(proposer, "load_memory"):
            return "restarted"
        path = self.folder / entry["file"]
        if not path.is_file():
            return "restarted"
        proposer.load_memory(path)
        return "restored"
