"""PNG plots of a bench run, drawn with matplotlib's Agg canvas (no display, no pyplot
global state): speedup per topic per method, per-unit speedup distribution, latency CDF and,
for calibrating methods (RECAP), the reliability diagram of their acceptance estimates."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from recap.bench.metrics import REFERENCE, paired_ratios

DPI = 110


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _colours(summary: dict) -> dict[str, str]:
    """One colour per method in every plot; AR in black."""
    drafters = [m for m in summary["methods"] if m != REFERENCE]
    return {REFERENCE: "black", **{m: f"C{i % 10}" for i, m in enumerate(drafters)}}


def _finite(value) -> float:
    return value if value is not None and not math.isnan(value) else 0.0


def speedup_by_topic(path: Path, summary: dict) -> None:
    """Grouped bars: S per topic (and overall) for every method, a line at 1 (AR)."""
    methods = [m for m in summary["methods"] if m != REFERENCE]
    groups = [*summary["topics"], "overall"]
    figure = _figure(max(6.0, 1.3 * len(groups) + 2), 4.2)
    axes = figure.add_subplot()
    width = 0.8 / max(1, len(methods))
    for index, method in enumerate(methods):
        data = summary["methods"][method]
        values = [_finite(data["topics"].get(t, {}).get("S")) for t in summary["topics"]] + [_finite(data["S"])]
        positions = [g + (index - (len(methods) - 1) / 2) * width for g in range(len(groups))]
        bars = axes.bar(positions, values, width, label=method, color=_colours(summary)[method])
        axes.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="AR")
    axes.set_xticks(range(len(groups)), [g.replace(" ", "\n") for g in groups], fontsize=8)
    axes.set_ylabel("speedup S vs AR (mean of paired ratios)")
    axes.set_title(f"Speedup per topic: {summary['run'].get('model')}, {summary['run'].get('dtype')}")
    axes.legend(fontsize=8)
    figure.savefig(path)


def speedup_distribution(path: Path, rows: Sequence[dict], summary: dict) -> None:
    """Per-unit paired ratios per method: box plot with every unit as a point."""
    methods = [m for m in summary["methods"] if m != REFERENCE]
    ratios = [[r for _, r in paired_ratios(rows, m) if not math.isnan(r)] for m in methods]
    figure = _figure(max(5.0, 1.4 * len(methods) + 2), 4.2)
    axes = figure.add_subplot()
    axes.boxplot([r or [math.nan] for r in ratios], showfliers=False)
    axes.set_xticks(range(1, len(methods) + 1), methods)
    for index, values in enumerate(ratios, 1):
        offsets = [index + 0.25 * ((k * 0.618) % 1 - 0.5) for k in range(len(values))]  # deterministic jitter
        axes.scatter(offsets, values, s=8, alpha=0.5, color=_colours(summary)[methods[index - 1]])
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axes.set_ylabel("per-unit throughput ratio vs AR")
    axes.set_title("Per-unit speedup distribution")
    figure.savefig(path)


def latency_cdf(path: Path, rows: Sequence[dict], summary: dict) -> None:
    """Empirical CDF of the per-unit wall time, one step line per method (AR included)."""
    figure = _figure(6.0, 4.2)
    axes = figure.add_subplot()
    for method in summary["methods"]:
        times = sorted(row["time_s"] for row in rows if row["method"] == method)
        if times:
            axes.step(times, [(k + 1) / len(times) for k in range(len(times))], where="post", label=method,
                      color=_colours(summary)[method])
    axes.set_xlabel("latency per unit, s (prefill + decoding)")
    axes.set_ylabel("share of units")
    axes.set_ylim(0, 1.02)
    axes.set_title("Latency CDF")
    axes.legend(fontsize=8)
    figure.savefig(path)


def reliability_diagram(path: Path, summary: dict) -> bool:
    """Observed acceptance against mean predicted probability per bin, one line per
    calibrating method (marker area ~ labelled nodes), the diagonal for reference. False
    (nothing drawn) when no method recorded labels."""
    methods = {m: data["reliability"] for m, data in summary["methods"].items()
               if data.get("reliability") and data["reliability"]["bins"]}
    if not methods:
        return False
    figure = _figure(5.2, 4.6)
    axes = figure.add_subplot()
    axes.plot([0, 1], [0, 1], color="black", linewidth=0.8, linestyle="--", label="perfect calibration")
    colours = _colours(summary)
    for method, table in methods.items():
        bins = table["bins"]
        largest = max(b["count"] for b in bins)
        ece = table["ece"]
        label = f"{method} (ECE {ece:.3f})" if ece is not None else method
        axes.plot([b["predicted"] for b in bins], [b["observed"] for b in bins], color=colours[method],
                  linewidth=1.2, label=label)
        axes.scatter([b["predicted"] for b in bins], [b["observed"] for b in bins], color=colours[method],
                     s=[12 + 88 * b["count"] / largest for b in bins], zorder=3)
    axes.set_xlim(0, 1)
    axes.set_ylim(0, 1.02)
    axes.set_xlabel("predicted acceptance probability (bin mean)")
    axes.set_ylabel("observed acceptance rate")
    axes.set_title("Reliability of acceptance estimates")
    axes.legend(fontsize=8, loc="upper left")
    figure.savefig(path)
    return True


def write_plots(out: Path, rows: Sequence[dict], summary: dict) -> list[Path]:
    out = Path(out)
    paths = [out / "speedup_by_topic.png", out / "speedup_distribution.png", out / "latency_cdf.png"]
    speedup_by_topic(paths[0], summary)
    speedup_distribution(paths[1], rows, summary)
    latency_cdf(paths[2], rows, summary)
    if reliability_diagram(out / "reliability.png", summary):
        paths.append(out / "reliability.png")
    else:
        (out / "reliability.png").unlink(missing_ok=True)  # a stale one of an earlier report
    return paths
