"""Reliability of RECAP's acceptance estimates in `recap bench`: row fields, summary, report, plot.

The end-to-end run uses a fresh tiny-llama with the flat cost profile (verification free, so
cost-aware RECAP drafts every candidate and labels nodes on any machine) and keeps it away
from the session-wide cached target, whose profile other tests rely on.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import recap
from recap.bench import BenchConfig, run_bench
from recap.bench.calibration import CHOSEN_NODES, RELIABILITY, method_calibration, snapshot, unit_fields
from recap.bench.report import build_summary, load_run, markdown, write_outputs
from recap.bench.results import ResultsFile
from recap.core.calibration import AcceptanceCalibrator, combine_reliability
from tests.test_bench import write_dataset


class _Calibrating:
    def __init__(self):
        self.calibrator = AcceptanceCalibrator()
        self.chosen_sizes: list[int] = []


def test_unit_fields_are_the_units_own_additions():
    proposer = _Calibrating()
    proposer.calibrator.record(np.array([0.05, 0.95]), np.array([False, True]))
    proposer.chosen_sizes += [10, 20]
    before = snapshot(proposer)
    proposer.calibrator.record(np.array([0.15, 0.12, 0.91]), np.array([True, False, True]))
    proposer.chosen_sizes += [3, 5]
    fields = unit_fields(proposer, before)
    assert fields[RELIABILITY]["counts"] == [0, 2, 0, 0, 0, 0, 0, 0, 0, 1]
    assert fields[RELIABILITY]["observed"] == [0, 1, 0, 0, 0, 0, 0, 0, 0, 1]
    assert fields[RELIABILITY]["predicted"][1] == pytest.approx(0.27)
    assert fields[CHOSEN_NODES] == 4.0
    assert unit_fields(proposer, snapshot(proposer)) == {}                 # nothing added: no fields
    proposer.calibrator.reset()                                           # a stream reset mid-decode
    proposer.chosen_sizes = [7]
    proposer.calibrator.record(np.array([0.5]), np.array([True]))
    fields = unit_fields(proposer, before)
    assert fields[RELIABILITY]["counts"][5] == 1 and sum(fields[RELIABILITY]["counts"]) == 1
    assert fields[CHOSEN_NODES] == 7.0
    assert unit_fields(object(), snapshot(object())) == {}                 # no calibrator, no sizes


def test_method_calibration_sums_units_and_skips_rows_without_fields():
    a = {"counts": [2, 0, 0, 0, 0, 0, 0, 0, 0, 1], "predicted": [0.1, 0, 0, 0, 0, 0, 0, 0, 0, 0.9],
         "observed": [0, 0, 0, 0, 0, 0, 0, 0, 0, 1]}
    b = {"counts": [1, 0, 0, 0, 0, 0, 0, 0, 0, 0], "predicted": [0.02, 0, 0, 0, 0, 0, 0, 0, 0, 0],
         "observed": [1, 0, 0, 0, 0, 0, 0, 0, 0, 0]}
    rows = [{RELIABILITY: a, CHOSEN_NODES: 4.0}, {RELIABILITY: b, CHOSEN_NODES: 2.0}, {}]
    summary = method_calibration(rows)
    table = summary[RELIABILITY]
    assert table["labels"] == 4 and table["units"] == 2 and summary[CHOSEN_NODES] == 3.0
    assert table["ece"] == pytest.approx(combine_reliability([a, b])["ece"])
    assert [b["bin"] for b in table["bins"]] == ["0.0-0.1", "0.9-1.0"]
    assert table["bins"][0]["count"] == 3 and table["bins"][0]["observed"] == pytest.approx(1 / 3)
    assert method_calibration([{}, {"method": "pld"}]) == {}


@pytest.fixture(scope="module")
def flat_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reliability")
    write_dataset(tmp / "mm")
    target = recap.load("tiny-llama")  # not the shared cached target: the flat profile stays here
    # the random model repeats itself only in the two-turn item, after a few tokens
    config = BenchConfig(model="tiny-llama", methods="recap,pld,recap-paper", data=str(tmp / "mm"),
                         topics=["multi turn"], max_new_tokens=24, out=tmp / "out", warmup=False,
                         cost_profile="flat")
    return run_bench(config, target=target, progress=False), tmp / "out"


def test_report_has_recaps_reliability_table_and_ece(flat_run):
    run, out = flat_run
    rows = ResultsFile(out).load()
    labelled = [r for r in rows if r["method"] == "recap" and r.get(RELIABILITY)]
    assert labelled, "recap labelled no drafted node"
    for row in rows:
        if row["method"] != "recap":     # AR and PLD have no calibrator; recap-paper scores nothing
            assert RELIABILITY not in row and CHOSEN_NODES not in row, row["method"]
    assert all(r.get(CHOSEN_NODES, 0) > 0 for r in labelled)                 # flat profile: it drafts
    for row in labelled:
        state = row[RELIABILITY]
        assert set(state) == {"counts", "predicted", "observed"} and all(len(v) == 10 for v in state.values())
        assert all(0 <= o <= c for o, c in zip(state["observed"], state["counts"]))
    summary = json.loads((out / "summary.json").read_text())
    table = summary["methods"]["recap"][RELIABILITY]
    assert table["labels"] == sum(sum(r[RELIABILITY]["counts"]) for r in labelled) and table["units"] == len(labelled)
    assert sum(b["count"] for b in table["bins"]) == table["labels"] and 0 <= table["ece"] <= 1
    assert isinstance(summary["methods"]["recap"][CHOSEN_NODES], float)
    for method in ("ar", "pld", "recap-paper"):
        assert RELIABILITY not in summary["methods"][method] and CHOSEN_NODES not in summary["methods"][method]
    report = (out / "report.md").read_text()
    assert "## Calibration of acceptance estimates" in report
    assert f"| recap | {table['labels']} | {table['ece']:.3f} |" in report
    assert f"### recap: reliability (ECE {table['ece']:.3f}, {table['labels']} labelled nodes)" in report
    assert "| bin | count | mean predicted | observed acceptance |" in report
    first = table["bins"][0]
    assert f"| {first['bin']} | {first['count']} | {first['predicted']:.3f} | {first['observed']:.3f} |" in report
    assert "| pld |" not in report.split("## Calibration")[1].split("## Output identity")[0]
    assert "![reliability](reliability.png)" in report
    png = (out / "reliability.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert run.summary["methods"]["recap"][RELIABILITY]["ece"] == table["ece"]


def test_rows_recorded_before_the_fields_still_report(flat_run, tmp_path):
    _, out = flat_run
    rows, record = load_run(out)
    old = [{k: v for k, v in row.items() if k not in (RELIABILITY, CHOSEN_NODES)} for row in rows]
    settings = {k: v for k, v in record["settings"].items() if k not in ("cost_profile", "device")}
    written = write_outputs(tmp_path, old, {**record, "settings": settings}, plots=True)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert all(RELIABILITY not in m for m in summary["methods"].values())
    report = (tmp_path / "report.md").read_text()
    assert "Calibration of acceptance estimates" not in report and "device cpu" in report
    assert not (tmp_path / "reliability.png").exists() and tmp_path / "reliability.png" not in written
    # a run resumed after the fields appeared: old rows add nothing, new rows add their labels
    mixed = old[: len(old) // 2] + rows[len(old) // 2:]
    table = build_summary(mixed, record)["methods"]["recap"].get(RELIABILITY)
    expected = [r[RELIABILITY] for r in rows[len(old) // 2:] if r.get(RELIABILITY)]
    assert (table is None) == (not expected)
    if expected:
        assert table["labels"] == combine_reliability(expected)["labels"]
        assert "### recap: reliability" in markdown(build_summary(mixed, record))
