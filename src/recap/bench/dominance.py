"""Dominance check: does ``recap`` keep up with the best method it contains, topic by topic
and unit by unit?

``recap``'s candidates include everything SAM and prompt lookup would draft, so a unit where
another method is clearly faster is a drafting bug to explain or fix (docs/methods.md). Per
topic: recap's mean S against the best other method's mean S. Per unit: every unit where
recap's paired ratio is below ``threshold`` (0.9) times the best other method's ratio on that
unit, with both methods' tau and verification steps, which do not depend on timing noise.
"""

from __future__ import annotations

from collections.abc import Sequence

from recap.bench.metrics import FLOAT_REFERENCE, REFERENCE, STOCK_REFERENCE, mean, paired_ratios, unit_tau

PRIMARY = "recap"
THRESHOLD = 0.9


def dominance(rows: Sequence[dict], primary: str = PRIMARY, threshold: float = THRESHOLD) -> dict | None:
    """``{"method", "threshold", "topics": {TOPIC: {"S", "best", "best_S", "ratio"}}, "units":
    [{"unit", "topic", "S", "tau", "steps", "best", "best_S", "best_tau", "best_steps"}]}``
    over the latest rows of a run; None when ``primary`` or every other drafter is missing."""
    labels = list(dict.fromkeys(row["method"] for row in rows))
    others = [label for label in labels if label not in (REFERENCE, STOCK_REFERENCE, FLOAT_REFERENCE, primary)]
    if primary not in labels or not others:
        return None
    per_unit = {label: {row["unit"]: (row, ratio) for row, ratio in paired_ratios(rows, label)}
                for label in (primary, *others)}
    topics: dict[str, dict] = {}
    for topic in dict.fromkeys(row["topic"] for row in rows):
        means = {label: mean(ratio for row, ratio in per_unit[label].values() if row["topic"] == topic)
                 for label in (primary, *others)}
        means = {label: value for label, value in means.items() if value == value}  # NaN: no units
        if primary not in means or len(means) < 2:
            continue
        best = max((label for label in others if label in means), key=lambda label: means[label])
        topics[topic] = {"S": means[primary], "best": best, "best_S": means[best],
                         "ratio": means[primary] / means[best] if means[best] else None}
    units = []
    for unit, (row, ratio) in per_unit[primary].items():
        rivals = [(per_unit[label][unit][1], label) for label in others if unit in per_unit[label]]
        if not rivals:
            continue
        best_ratio, best = max(rivals)
        if ratio < threshold * best_ratio:
            other = per_unit[best][unit][0]
            units.append({"unit": unit, "topic": row["topic"], "S": ratio, "tau": unit_tau(row["accepted"],
                          row["iterations"]), "steps": row["iterations"], "best": best, "best_S": best_ratio,
                          "best_tau": unit_tau(other["accepted"], other["iterations"]),
                          "best_steps": other["iterations"]})
    units.sort(key=lambda u: u["S"] / u["best_S"])
    return {"method": primary, "threshold": threshold, "topics": topics, "units": units}


def _f(value, fmt: str) -> str:
    return "–" if value is None or value != value else fmt.format(value)


def markdown_section(check: dict | None) -> list[str]:
    """The report's "Dominance" section (nothing without a check)."""
    if not check:
        return []
    primary = check["method"]
    lines = ["## Dominance: does " + primary + " keep up with the best other method?", "",
             f"Per topic, {primary}'s mean S against the best other method's mean S on that topic; then every unit "
             f"where {primary}'s ratio is below {check['threshold']:.1f}x the best other method's on that unit, with "
             "both methods' tau and verification steps (timing-independent). Such a unit is a drafting gap to "
             "explain or fix (docs/methods.md).", "",
             f"| topic | {primary} S | best other | its S | {primary} / best |", "| --- | --- | --- | --- | --- |"]
    for topic, t in check["topics"].items():
        ratio = t["ratio"]
        mark = "" if ratio is None or ratio >= 1 else " (behind)"
        lines.append(f"| {topic} | {_f(t['S'], '{:.2f}x')} | {t['best']} | {_f(t['best_S'], '{:.2f}x')} | "
                     f"{_f(ratio, '{:.2f}')}{mark} |")
    lines.append("")
    units = check["units"]
    if not units:
        lines += [f"No unit where {primary} is below {check['threshold']:.1f}x the best other method.", ""]
        return lines
    lines += [f"{len(units)} unit(s) where {primary} is below {check['threshold']:.1f}x the best other method:", "",
              f"| unit | topic | {primary} S | tau | steps | best | its S | tau | steps |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for u in units:
        lines.append(f"| {u['unit']} | {u['topic']} | {_f(u['S'], '{:.2f}x')} | {_f(u['tau'], '{:.2f}')} | "
                     f"{u['steps']} | {u['best']} | {_f(u['best_S'], '{:.2f}x')} | {_f(u['best_tau'], '{:.2f}')} | "
                     f"{u['best_steps']} |")
    lines.append("")
    return lines
