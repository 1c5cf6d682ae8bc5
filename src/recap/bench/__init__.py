"""``recap bench``: paired, resumable benchmarks with the paper's metrics, tables and plots.

    from recap.bench import BenchConfig, run_bench
    run = run_bench(BenchConfig(model="smollm2-135m", methods="recap,pld", limit=5, out="bench-out"))
    print(run.summary["methods"]["recap"]["S"])

Modules: `data` (MMSpec-format inputs and units), `runner` (paired runs, resume), `streams`
(method specs, stream checkpoints), `results` (results.jsonl / run.json), `metrics` (pure
functions), `report` (summary.json, report.md), `plots` (PNGs), `environment` (machine,
versions).
"""

from __future__ import annotations

from recap.bench.runner import Bench, BenchConfig, BenchRun
from recap.verifier import TargetModel


def run_bench(config: BenchConfig, *, target: TargetModel | None = None, console=None,
              progress: bool = True) -> BenchRun:
    """Run (or resume) a benchmark and, unless interrupted, write summary.json, report.md
    and the plots next to results.jsonl."""
    from recap.bench.report import build_summary, write_outputs
    from recap.bench.runner import run_record

    run = Bench(config, target=target, console=console, progress=progress).run()
    record = run_record(run.out)
    if run.interrupted:
        run.summary = build_summary(run.rows, record) if run.rows else None
    else:
        run.files = write_outputs(run.out, run.rows, record)
        run.summary = build_summary(run.rows, record)
    return run


__all__ = ["Bench", "BenchConfig", "BenchRun", "run_bench"]
