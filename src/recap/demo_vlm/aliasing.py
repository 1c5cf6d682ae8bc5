"""Condition aliasing, measured: is a Top-K row computed under another image as good a guess
as one computed under the current image?

For each request the target's Top-K row after every position of prompt + greedy output is
recorded (one teacher-forced forward). At each generated position t, the last 1, 2 and 3
committed tokens form keys; a *same-image* row is the most recent row with that key earlier in
the same request (what RECAP's request-local C/G hold), a *different-image* row the most recent
row with that key from the other requests (what a token-keyed memory shared across requests
holds). Recall is the share of lookups whose row contains the target's greedy token at t
(top-1: whose first entry is that token).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

KEY_LENGTHS = (1, 2, 3)


@dataclass
class RequestRows:
    """One request: its token ids (prompt + output), Top-K rows after each position, which
    positions may serve as keys (no image placeholders), and where the output starts."""

    ids: list[int]
    topk: np.ndarray
    eligible: np.ndarray
    output_start: int

    def keyed_rows(self, n: int, end: int | None = None) -> dict[tuple[int, ...], np.ndarray]:
        """Key (last ``n`` tokens ending at p) -> row after p, the latest p < ``end`` winning."""
        rows: dict[tuple[int, ...], np.ndarray] = {}
        end = len(self.ids) if end is None else end
        for p in range(n - 1, end):
            if self.eligible[p - n + 1 : p + 1].all():
                rows[tuple(self.ids[p - n + 1 : p + 1])] = self.topk[p]
        return rows


@dataclass
class Recall:
    hits: int = 0
    top1: int = 0
    lookups: int = 0

    def add(self, row: np.ndarray, greedy: int) -> None:
        self.lookups += 1
        self.hits += int(greedy in row)
        self.top1 += int(row[0] == greedy)

    def as_dict(self) -> dict[str, float]:
        return {"lookups": self.lookups, "recall": self.hits / self.lookups if self.lookups else float("nan"),
                "top1": self.top1 / self.lookups if self.lookups else float("nan")}


@dataclass
class AliasingReport:
    """Recall per key length: over every lookup that found a row of that kind, and over the
    paired lookups where both a same-image and a different-image row existed (the fairer
    comparison: same positions, same keys, only the image differs)."""

    same: dict[int, Recall] = field(default_factory=lambda: defaultdict(Recall))
    different: dict[int, Recall] = field(default_factory=lambda: defaultdict(Recall))
    same_paired: dict[int, Recall] = field(default_factory=lambda: defaultdict(Recall))
    different_paired: dict[int, Recall] = field(default_factory=lambda: defaultdict(Recall))
    same_content: dict[int, Recall] = field(default_factory=lambda: defaultdict(Recall))
    different_content: dict[int, Recall] = field(default_factory=lambda: defaultdict(Recall))
    """Paired lookups whose greedy token states an image attribute (``content``)."""

    def as_dict(self) -> dict[str, dict[str, dict[str, float]]]:
        return {f"{n}-token key": {"same image": self.same[n].as_dict(), "different image": self.different[n].as_dict(),
                                   "same image, paired": self.same_paired[n].as_dict(),
                                   "different image, paired": self.different_paired[n].as_dict(),
                                   "same image, paired, content": self.same_content[n].as_dict(),
                                   "different image, paired, content": self.different_content[n].as_dict()}
                for n in KEY_LENGTHS}


@torch.inference_mode()
def request_rows(target, inputs, output: list[int], top_k: int = 8) -> RequestRows:
    """Top-K rows after every position of prompt + output, from one teacher-forced forward."""
    prompt = inputs.input_ids[0].tolist()
    ids = torch.tensor([prompt + output])
    extra = {k: v for k, v in inputs.extra.items() if k != "attention_mask"}
    logits = target.model(input_ids=ids, **extra).logits[0]
    topk = torch.topk(logits.float(), top_k, dim=-1).indices.numpy()
    excluded = target.excluded_tokens
    eligible = np.array([t not in excluded for t in prompt + output], dtype=bool)
    return RequestRows(ids=prompt + output, topk=topk, eligible=eligible, output_start=len(prompt))


def measure(requests: list[RequestRows], content: Callable[[int], bool] | None = None) -> AliasingReport:
    """Same-image vs different-image recall over every generated position of every request;
    ``content(token)`` marks the greedy tokens that state something about the image (where
    aliasing can hurt; template words are the same whatever the image)."""
    report = AliasingReport()
    for index, request in enumerate(requests):
        others = [r for i, r in enumerate(requests) if i != index]
        for n in KEY_LENGTHS:
            foreign: dict[tuple[int, ...], np.ndarray] = {}
            for other in others:
                foreign.update(other.keyed_rows(n))
            own: dict[tuple[int, ...], np.ndarray] = {}
            known = n - 1  # rows after positions < known are in `own`
            for t in range(request.output_start - 1, len(request.ids) - 1):
                for p in range(known, t):  # rows strictly earlier in this request
                    if request.eligible[p - n + 1 : p + 1].all():
                        own[tuple(request.ids[p - n + 1 : p + 1])] = request.topk[p]
                known = max(known, t)
                if not request.eligible[t - n + 1 : t + 1].all():
                    continue
                key = tuple(request.ids[t - n + 1 : t + 1])
                greedy = request.ids[t + 1]
                if key in own:
                    report.same[n].add(own[key], greedy)
                if key in foreign:
                    report.different[n].add(foreign[key], greedy)
                if key in own and key in foreign:
                    report.same_paired[n].add(own[key], greedy)
                    report.different_paired[n].add(foreign[key], greedy)
                    if content is not None and content(greedy):
                        report.same_content[n].add(own[key], greedy)
                        report.different_content[n].add(foreign[key], greedy)
    return report
