"""summary.json (for scripts) and report.md (for people) from results.jsonl and run.json.

summary.json: ``{"schema", "run", "units", "topics", "mismatches", "methods": {NAME: {"S",
"tau", "mismatches", "topics": {TOPIC: {"S", "tau", ...}}, "ratio", "latency_s", "stages",
...}}}``; a calibrating method (RECAP) also has ``"reliability": {"bins": [{"bin", "count",
"predicted", "observed"}], "ece", "labels", "units"}`` and ``"chosen_nodes_mean"``. report.md
has the paper's table shapes (methods x topics, S and tau), the per-unit ratio distribution,
latency, stage costs, the calibration of acceptance estimates, output identity and the run's
settings, and embeds the plots. Mismatches against AR are shown first, never folded away.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from recap.bench.compiles import WARNING, compiled_units
from recap.bench.dominance import dominance
from recap.bench.dominance import markdown_section as dominance_section
from recap.bench.metrics import FLOAT_REFERENCE, REFERENCE, STOCK_REFERENCE, summarise_method
from recap.bench.results import RESULTS, write_json_atomic
from recap.bench.runner import REPEATS, ROTATION, WARMUP, latest_rows
from recap.check import claims_exact

SCHEMA = "recap-bench/1"
STREAM_POLICY = ("fresh proposer per method and topic (persistent memories such as RECAP's U and Token Recycling's "
                 "matrix start empty at each topic and are carried across its inputs; methods never share state); "
                 "request-local memories reset at every request; on resume a stateful stream is restored from the "
                 "checkpoint saved after its last finished unit (save_memory, e.g. RECAP's U in float32) or, "
                 "without one, restarted cold at the resume point: every such event is listed")


def build_summary(rows: Sequence[dict], record: dict) -> dict:
    """Every metric per method (AR included, S = 1 by construction) and the run block."""
    rows = list(latest_rows(rows).values())
    settings = record.get("settings", {})
    labels = list(settings.get("methods") or dict.fromkeys(row["method"] for row in rows))
    topics = list(dict.fromkeys(row["topic"] for row in rows))
    methods = {label: summarise_method(rows, label, topics) for label in labels}
    sessions = record.get("sessions", [])
    last = sessions[-1] if sessions else {}
    reference = [row for row in rows if row["method"] == REFERENCE]
    images_used = bool(record.get("images_used"))
    run = {
        **settings,
        "images_used": images_used,
        "images_note": "the model takes images: each input's image goes into its first user turn" if images_used
        else "text-only model: every question is asked without its image",
        "turn_is_request": True,
        "multi_turn": "each turn is one generation unit and one request (request-local memories reset per turn); "
                      "later turns get the earlier questions and AR's own earlier answers, for every method",
        "timing": "wall time of prefill + decoding per unit (recap.decode total_s); data loading, image decoding "
                  "and tokenisation are not timed; gc.collect() runs untimed before each decode",
        "rotation": ROTATION,
        "warmup": WARMUP if settings.get("warmup", True) else "none",
        "repeats": REPEATS.format(n=settings["repeats"]) if settings.get("repeats", 1) > 1
        else "one timed decode per (unit, method)",
        "streams": STREAM_POLICY,
        "stream_events": [event for session in sessions for event in session.get("stream_events", [])],
        "machine": last.get("machine"),
        "versions": last.get("versions"),
        "threads_pinned": last.get("threads"),
        "threads_ran": last.get("threads_ran"),
        "kernels": last.get("kernels", "stock"),
        "sessions": [{key: session.get(key) for key in ("started", "units_done_before", "units_run", "wall_s",
                                                       "interrupted")} for session in sessions],
        "units_selected": last.get("units_selected"),
        "notes": [f"{label}: the model has no image tokens, so it behaves as sam" for label in labels
                  if label.split(":")[0] == "sam-viskip" and not images_used],
    }
    return {
        "schema": SCHEMA,
        "run": run,
        "units": len(reference),
        "inputs": len({row["item"] for row in reference}),
        "topics": {topic: sum(row["topic"] == topic for row in reference) for topic in topics},
        "complete": last.get("units_selected") is not None and len(reference) >= last["units_selected"],
        "mismatches": sum(methods[label]["mismatches"] for label in labels
                          if label not in (REFERENCE, STOCK_REFERENCE)),
        "methods": methods,
        "dominance": dominance(rows),
        "compiled_units": compiled_units(rows),
    }


def _json_safe(value):
    """NaN is not JSON: write it as null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    return value


def _f(value: float | None, fmt: str = "{:.2f}", missing: str = "–") -> str:
    return missing if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]


def _calibration_section(methods: dict) -> list[str]:
    """Reliability of the acceptance estimates of calibrating methods (RECAP and its
    ablations): one line per method, then one table per method; nothing for a run without."""
    calibrating = [label for label, m in methods.items() if m.get("reliability") or m.get("chosen_nodes_mean")]
    if not calibrating:
        return []
    lines = ["## Calibration of acceptance estimates", "",
             "Each verification labels every drafted node whose parent was accepted: accepted or not. Per bin of the "
             "probability the method predicted for such nodes: how many there were, their mean prediction and the "
             "share accepted, summed over all units. ECE (expected calibration error) = count-weighted mean "
             "|predicted - observed|.", "",
             *_table(["method", "labelled nodes", "ECE", "chosen draft nodes/step"],
                     [[label, str(methods[label].get("reliability", {}).get("labels", 0)),
                       _f(methods[label].get("reliability", {}).get("ece"), "{:.3f}"),
                       _f(methods[label].get("chosen_nodes_mean"), "{:.1f}")] for label in calibrating]), ""]
    for label in calibrating:
        table = methods[label].get("reliability")
        if not table or not table["bins"]:
            continue
        lines += [f"### {label}: reliability (ECE {_f(table['ece'], '{:.3f}')}, {table['labels']} labelled nodes)",
                  "",
                  *_table(["bin", "count", "mean predicted", "observed acceptance"],
                          [[b["bin"], str(b["count"]), _f(b["predicted"], "{:.3f}"), _f(b["observed"], "{:.3f}")]
                           for b in table["bins"]]), ""]
    return lines


def _threads(run: dict) -> str:
    """The thread count as read back after the run (runs from before the read-back say
    only what was asked)."""
    ran = run.get("threads_ran")
    if not ran:
        return f"{run.get('threads_pinned')} thread(s) asked (not read back)"
    counts = ", ".join(f"{name} {count}" for name, count in ran.items() if count is not None)
    return f"{ran.get('torch')} thread(s) (read back after the run: {counts})"


def markdown(summary: dict, plots: Sequence[str] = ()) -> str:
    run = summary["run"]
    methods = summary["methods"]
    drafters = [label for label in methods if label != REFERENCE]
    topics = list(summary["topics"])
    exact = claims_exact(str(run.get("dtype")), str(run.get("kernels", "stock")))
    lines = [f"# recap bench: {run.get('model')}, {run.get('dtype')}, {run.get('kernels', 'stock')} kernels, "
             f"{_threads(run)}", ""]
    if summary["mismatches"]:
        lines += [f"> **MISMATCH: {summary['mismatches']} output(s) differ from AR.**"
                  + (" This breaks losslessness: treat it as a bug." if exact else
                     f" In {run.get('dtype')} multi-token forwards round differently from one-token forwards, so "
                     "near-ties can flip; these are counted, not claimed exact."), ">"]
        for label in drafters:
            bad = methods[label]["mismatched_units"]
            if bad and label != STOCK_REFERENCE:
                shown = ", ".join(f"{m['unit']} (token {m['first_difference']})" for m in bad[:20])
                lines.append(f"> - **{label}**: {len(bad)} of {methods[label]['units']} units differ: {shown}"
                             + (" ..." if len(bad) > 20 else ""))
        lines.append("")
    else:
        lines += [f"Every output of every method is identical to AR's ({summary['units']} units x "
                  f"{len(drafters)} methods).", ""]
    compiled = summary.get("compiled_units") or []
    if compiled:
        seconds = sum(unit["compile_s"] for unit in compiled)
        shown = ", ".join(f"{unit['method']} on {unit['unit']} ({unit['compile_s']:.1f} s)" for unit in compiled[:10])
        lines += [f"> **Compiles inside timing**: {WARNING.format(count=len(compiled), seconds=seconds)}. "
                  f"{shown}" + (" ..." if len(compiled) > 10 else ""), ""]
    if STOCK_REFERENCE in methods:
        stock = methods[STOCK_REFERENCE]
        differ = ", ".join(f"{m['unit']} (token {m['first_difference']})" for m in stock["mismatched_units"][:20])
        lines += [f"`{STOCK_REFERENCE}` is plain AR on stock transformers; `ar` and every method run on "
                  f"the {run.get('kernels')} kernels. Agreement of stock with them (a rate, not an "
                  f"exactness claim): {stock['units'] - stock['mismatches']} of {stock['units']} outputs identical"
                  + (f"; differing: {differ}" if differ else "") + ".", ""]
    if FLOAT_REFERENCE in methods:
        floats = methods[FLOAT_REFERENCE]
        lines += [f"`{FLOAT_REFERENCE}` is plain AR on the model's float weights; `ar` and every method read "
                  "the GGUF blocks as stored: "
                  f"{floats['units'] - floats['mismatches']} of {floats['units']} outputs identical (any "
                  f"difference is a mismatch above); `ar` is {_f(1 / floats['S'] if floats['S'] else None, '{:.2f}x')} "
                  f"as fast as `{FLOAT_REFERENCE}`.", ""]
    if not summary["complete"]:
        lines += [f"**Partial run**: {summary['units']} of {run.get('units_selected')} selected units finished; "
                  "rerun the same command to resume.", ""]
    overall = ", ".join(f"{label} {_f(methods[label]['S'], '{:.2f}x')} (tau {_f(methods[label]['tau'])})"
                        for label in drafters)
    lines += [f"{summary['units']} units ({summary['inputs']} inputs, {len(topics)} topics); speedup vs AR: "
              f"{overall}.", ""]

    def by_topic(key: str, fmt: str, names: Sequence[str]) -> list[str]:
        rows = [[label, *(_f(methods[label]["topics"].get(t, {}).get(key), fmt) for t in topics),
                 _f(methods[label][key], fmt)] for label in names]
        return _table(["method", *topics, "overall"], rows)

    lines += ["## Speedup S (mean of paired per-unit throughput ratios vs AR)", "",
              *by_topic("S", "{:.2f}x", drafters), "",
              "## Acceptance length tau (1 + mean accepted draft tokens per verification)", "",
              *by_topic("tau", "{:.2f}", [REFERENCE, *drafters]), "",
              "Overall values weight every unit (each turn of a multi-turn input) equally. Units per topic: "
              + ", ".join(f"{t} {n}" for t, n in summary["topics"].items()) + ".", ""]
    lines += ["## Per-unit speedup distribution", "",
              *_table(["method", "P10", "P50", "P90", "faster than AR"],
                      [[label, _f(methods[label]["ratio"]["p10"], "{:.2f}x"), _f(methods[label]["ratio"]["p50"],
                        "{:.2f}x"), _f(methods[label]["ratio"]["p90"], "{:.2f}x"),
                        _f(methods[label]["ratio"]["faster_share"], "{:.0%}")] for label in drafters]), ""]
    lines += ["## Latency per unit (prefill + decoding)", "",
              *_table(["method", "P50 s", "P90 s", "P95 s", "P99 s", "mean tok/s", "tokens"],
                      [[label, *(_f(methods[label]["latency_s"][p], "{:.2f}") for p in ("p50", "p90", "p95", "p99")),
                        _f(methods[label]["tokens_per_s"], "{:.1f}"), str(methods[label]["tokens"])]
                       for label in methods]), ""]
    spreads = {label: methods[label]["round_spread"] for label in methods if "round_spread" in methods[label]}
    if spreads:
        lines += ["Each row is its method's median-time round; how far a unit's rounds lay apart (median over units "
                  "of (slowest - fastest) / median): " + ", ".join(f"{label} {value:.0%}"
                                                                 for label, value in spreads.items()) + ".", ""]
    lines += ["## Where the time goes", "",
              "propose and observe are the drafter's host work; verify is the model forward plus tree packing and KV "
              "compaction.", "",
              *_table(["method", "prefill ms/unit", "propose ms/iter", "verify ms/iter", "observe ms/iter",
                       "draft nodes/iter"],
                      [[label, *(_f(methods[label]["stages"][k], "{:.2f}") for k in
                                 ("prefill_ms_per_unit", "propose_ms_per_iteration", "verify_ms_per_iteration",
                                  "observe_ms_per_iteration")),
                        _f(methods[label]["stages"]["draft_nodes_per_iteration"], "{:.1f}")] for label in methods]),
              ""]
    lines += dominance_section(summary.get("dominance"))
    lines += _calibration_section(methods)
    lines += ["## Output identity against AR", "",
              *_table(["method", "units", "identical", "mismatches"],
                      [[label, str(m["units"]), str(m["units"] - m["mismatches"]),
                        f"**{m['mismatches']}**" if m["mismatches"] else "0"]
                       for label, m in ((label, methods[label]) for label in drafters)]), ""]
    if plots:
        lines += ["## Plots", "", *(f"![{Path(p).stem}]({p})" for p in plots), ""]
    events = run.get("stream_events") or []
    sessions = run.get("sessions") or []
    machine = run.get("machine") or {}
    versions = run.get("versions") or {}
    lines += ["## How this was measured", "",
              f"- model `{run.get('model')}`, dtype {run.get('dtype')}, device {run.get('device', 'cpu')}, "
              f"{_threads(run)}, greedy, at most {run.get('max_new_tokens')} new tokens per unit, "
              f"seed {run.get('seed')}",
              f"- machine: {machine.get('cpu')}, {machine.get('cores_available')} cores available; "
              + ", ".join(f"{k} {v}" for k, v in versions.items()),
              f"- data: `{run.get('data')}`; images: {run['images_note']}",
              f"- system prompt (MMSpec's): \"{run.get('system_prompt')}\"",
              f"- multi-turn: {run['multi_turn']}",
              f"- pairing: AR and every method decode each unit in the same process; order {run['rotation']}",
              f"- warm-up: {run['warmup']}",
              f"- repeats: {run.get('repeats', 'one timed decode per (unit, method)')}",
              f"- timing: {run['timing']}",
              f"- streams: {run['streams']}",
              f"- sessions: {len(sessions)}" + (f" (resumed {len(sessions) - 1} time(s))" if len(sessions) > 1 else ""),
              ]
    lines += [f"- note: {note}" for note in run.get("notes", [])]
    if events:
        lines.append("- stream events on resume: " + "; ".join(
            f"{e['method']} in {e['topic']} {e['event']} after {e['after_unit']}" for e in events))
    lines.append("")
    return "\n".join(lines)


def write_outputs(out: Path, rows: Sequence[dict], record: dict, *, plots: bool = True) -> list[Path]:
    """summary.json, report.md and the PNG plots in ``out``; returns the paths written."""
    out = Path(out)
    summary = build_summary(rows, record)
    written = []
    names: list[str] = []
    if plots and summary["units"]:
        from recap.bench.plots import write_plots

        pngs = write_plots(out, list(latest_rows(rows).values()), summary)
        written += pngs
        names = [p.name for p in pngs]
    write_json_atomic(out / "summary.json", _json_safe(summary))
    (out / "report.md").write_text(markdown(summary, names))
    return [out / "summary.json", out / "report.md", *written]


def load_run(out: Path) -> tuple[list[dict], dict]:
    """results.jsonl rows and run.json of an output folder (for ``--report-only``)."""
    from recap.bench.results import ResultsFile
    from recap.errors import InputError

    out = Path(out)
    if not (out / RESULTS).exists() or not (out / "run.json").exists():
        raise InputError(f"{out} holds no bench results ({RESULTS} and run.json)")
    return ResultsFile(out).load(), json.loads((out / "run.json").read_text())

