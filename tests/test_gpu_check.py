"""benchmarks/gpu_check.py: one line without CUDA, and its --device cpu --quick miniature."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def _run(*arguments: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_fails_on_one_line(tmp_path):
    done = _run("--out", str(tmp_path / "check.json"), timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("gpu_check: CUDA is not available")
    assert not (tmp_path / "check.json").exists()
    done = _run("--device", "cpu", "--out", str(tmp_path / "check.json"), timeout=60)   # the full run needs a GPU
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--quick" in done.stderr


@pytest.mark.slow
def test_quick_mode_runs_every_phase_on_cpu(tmp_path):
    out = tmp_path / "check.json"
    done = _run("--device", "cpu", "--quick", "--out", str(out), timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()
    assert summary[0].startswith("gpu_check on cpu") and summary[0].endswith("OK")
    assert summary[1].startswith("losslessness (float32, vary): 8/8 model-method pairs lossless")
    assert summary[2].startswith("verify cost tiny-llama t(N)/t(1): @L=16")
    assert summary[3].startswith("bench tiny-llama (2 units, 8 new tokens, data synthetic): recap S ")
    assert "lookahead S" in summary[3] and summary[-1] == f"wrote {out}"
    assert summary[4].startswith("fast kernels on the host CPU (tiny-llama, ")
    data = json.loads(out.read_text())
    assert data["ok"] is True and data["quick"] is True and data["summary_text"] == done.stdout.strip()
    rows = data["check"]["results"]
    assert {(r["model"], r["method"]) for r in rows} == {(m, k) for m in ("tiny-llama", "tiny-qwen2.5-vl")
                                                        for k in ("recap", "recap-paper", "sam", "pld")}
    assert all(r["cases"] == 2 and r["passed"] == 2 and r["error"] is None for r in rows)
    profile = data["profile"]
    assert profile["sizes"] == [1, 2, 4, 8] and set(profile["relative"]) == {"16", "64"}
    assert all(ratios["1"] == pytest.approx(1.0) for ratios in profile["relative"].values())
    assert Path(profile["file"]).is_file()
    bench = data["bench"]
    assert set(bench["results"]) == {"ar", "recap", "recap-paper", "pld", "sam", "lookahead"}
    assert bench["mismatches"] == 0 and bench["units"] == 2 and "## Speedup S" in bench["report_md"]
    assert all(isinstance(m["S"], float) and isinstance(m["tau"], float) for m in bench["results"].values())
    host = data["host"]       # phase 4: the fast kernels on this CPU at 1 thread and every core
    assert host["error"] is None and host["context"] == 16 and host["device_t1_ms"] == profile["t1_ms"]["16"]
    assert [r["threads"] for r in host["runs"]] == list(dict.fromkeys((1, host["cores"])))
    assert all(set(r["t_ms"]) == {"1", "8", "32"} and all(t > 0 for t in r["t_ms"].values()) for r in host["runs"])
    assert isinstance(host["fast_host_faster_than_device"], bool)
    run = json.loads((tmp_path / "check-bench" / "run.json").read_text())
    assert "device" not in run["settings"]           # the CPU is the default: not recorded, old runs resume
