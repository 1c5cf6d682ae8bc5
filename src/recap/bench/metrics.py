"""The paper's metrics (DESIGN.md section 8) as pure functions over results rows.

A row is one generation unit run by one method (see `recap.bench.runner` for its fields).
Definitions:

- throughput of a unit: output tokens / wall time (prefill + decoding);
- paired ratio r_i = throughput(method, i) / throughput(AR, i), same unit, same process;
- speedup S = mean of the paired ratios (not the ratio of mean throughputs: every unit
  counts once, whatever its length);
- tau of a unit = 1 + accepted draft tokens / verification iterations (the 1 is the
  target's own bonus token); tau of a method = mean over units. Units with no iteration
  (EOS or the token limit right after prefill) have no tau and are left out of it;
- overall values are turn-weighted: every unit (each turn of a multi-turn item) counts once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from recap.bench.calibration import method_calibration

REFERENCE = "ar"
FLOAT_REFERENCE = "ar-float"
"""Plain AR on the float weights of a model read as GGUF blocks (``--reference float``): its
outputs must equal AR's on the blocks, token for token (a mismatch fails the run), and its
speed shows what reading the blocks as stored buys."""
STOCK_REFERENCE = "ar-stock"
"""Plain AR on stock transformers (``--reference stock``): its outputs are compared with AR's
for agreement only, since on the fast kernels near-ties may round the other way."""


def throughput(row: dict) -> float:
    """Output tokens per second of one unit."""
    return row["n_tokens"] / row["time_s"] if row["time_s"] > 0 else math.nan


def unit_tau(accepted: int, iterations: int) -> float | None:
    """1 + mean accepted draft tokens per verification; None without any verification."""
    return 1.0 + accepted / iterations if iterations > 0 else None


def mean(values: Iterable[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default, Hyndman-Fan type 7); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must lie in [0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def paired_ratios(rows: Sequence[dict], method: str) -> list[tuple[dict, float]]:
    """(row, r_i) for every unit where both ``method`` and AR ran."""
    reference = {row["unit"]: row for row in rows if row["method"] == REFERENCE}
    pairs = []
    for row in rows:
        if row["method"] == method and row["unit"] in reference:
            pairs.append((row, throughput(row) / throughput(reference[row["unit"]])))
    return pairs


def speedup(ratios: Sequence[float]) -> float:
    """S: the mean of paired per-unit ratios."""
    return mean(ratios)


def method_tau(rows: Sequence[dict]) -> float:
    """Mean over units of the unit tau (units without iterations left out)."""
    return mean(unit_tau(row["accepted"], row["iterations"]) for row in rows)


def ratio_distribution(ratios: Sequence[float]) -> dict[str, float]:
    """P10/P50/P90 of the paired ratios and the share of units faster than AR."""
    return {"p10": percentile(ratios, 10), "p50": percentile(ratios, 50), "p90": percentile(ratios, 90),
            "faster_share": sum(r > 1 for r in ratios) / len(ratios) if ratios else math.nan}


def latency(rows: Sequence[dict]) -> dict[str, float]:
    """Per-unit wall time (prefill + decoding) percentiles, in seconds."""
    times = [row["time_s"] for row in rows]
    return {f"p{q}": percentile(times, q) for q in (50, 90, 95, 99)}


def round_spread(rows: Sequence[dict]) -> float | None:
    """How far a unit's timed rounds lay apart (``--repeats``): the median over units of
    (slowest - fastest) / median round time; None for rows timed once."""
    spreads = []
    for row in rows:
        times = row.get("round_times_s")
        if times and len(times) > 1 and percentile(times, 50) > 0:
            spreads.append((max(times) - min(times)) / percentile(times, 50))
    return percentile(spreads, 50) if spreads else None


def stage_costs(rows: Sequence[dict]) -> dict[str, float]:
    """Where the time went: prefill per unit, and propose / verify / observe per iteration
    (ms). Propose and observe are the drafter's host work; verify is the model's forward
    plus tree packing and KV compaction."""
    iterations = sum(row["iterations"] for row in rows)
    per_iteration = {stage: 1000 * sum(row[f"{stage}_s"] for row in rows) / iterations if iterations else math.nan
                     for stage in ("propose", "verify", "observe")}
    return {"prefill_ms_per_unit": 1000 * mean(row["prefill_s"] for row in rows),
            **{f"{stage}_ms_per_iteration": value for stage, value in per_iteration.items()},
            "draft_nodes_per_iteration": sum(row["draft_nodes"] for row in rows) / iterations if iterations
            else math.nan}


def summarise_method(rows: Sequence[dict], method: str, topics: Sequence[str]) -> dict:
    """Every metric of one method: S, tau and mismatches overall and per topic, the ratio
    distribution, latency percentiles and stage costs; for a calibrating method also its
    reliability table and mean chosen draft size (`recap.bench.calibration`)."""
    mine = [row for row in rows if row["method"] == method]
    pairs = paired_ratios(rows, method)
    ratios = [ratio for _, ratio in pairs]
    mismatched = [row for row in mine if not row["identical"]]
    per_topic = {}
    for topic in topics:
        topic_rows = [row for row in mine if row["topic"] == topic]
        if not topic_rows:
            continue
        topic_ratios = [ratio for row, ratio in pairs if row["topic"] == topic]
        per_topic[topic] = {"S": speedup(topic_ratios), "tau": method_tau(topic_rows), "units": len(topic_rows),
                            "mismatches": sum(not row["identical"] for row in topic_rows),
                            "tokens_per_s": mean(throughput(row) for row in topic_rows)}
    return {
        "S": speedup(ratios),
        "tau": method_tau(mine),
        "mismatches": len(mismatched),
        "mismatched_units": [{"unit": row["unit"], "first_difference": row["first_difference"]} for row in mismatched],
        "units": len(mine),
        "tokens": sum(row["n_tokens"] for row in mine),
        "tokens_per_s": mean(throughput(row) for row in mine),
        "ratio": ratio_distribution(ratios),
        "latency_s": latency(mine),
        "stages": stage_costs(mine),
        **({"round_spread": spread} if (spread := round_spread(mine)) is not None else {}),
        "topics": per_topic,
        **method_calibration(mine),
    }


def first_difference(output: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first token where two outputs differ (None when identical)."""
    for index, (a, b) in enumerate(zip(output, reference)):
        if a != b:
            return index
    return None if len(output) == len(reference) else min(len(output), len(reference))
