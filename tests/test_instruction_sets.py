"""The same model gives the same logits whatever x86 CPU the kernels are compiled for.

Every sum of the fast kernels is written in `recap.verifier.kernels.lanes` order, so the bits
cannot depend on the instruction set. Checked on one machine by compiling the kernels in
subprocesses for other CPUs (``NUMBA_CPU_NAME`` with ``NUMBA_CPU_FEATURES``, each with its own
numba cache), reading back what was compiled, and comparing logits bit for bit with the
native build: an AVX2 build without any AVX-512 feature (a Zen 3 core's instruction set,
built on a Zen 4 one; where the host has no AVX-512 it is the host's own) and a baseline
x86-64 build (SSE2 only, no FMA instruction: ``llvm.fma`` becomes a call to the C library's
``fmaf``, exact but slow, so SmolLM2 is left out there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import llvmlite.binding as llvm
import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["tiny-llama", "tiny-gemma3", "tiny-qwen2.5-vl", "tiny-llava-next"]


def _avx2_features() -> str:
    """This host's features with every AVX-512 (and AVX10) one switched off."""
    features = llvm.get_host_cpu_features()
    return ",".join(("+" if on and not name.startswith(("avx512", "avx10", "evex512")) else "-") + name
                    for name, on in sorted(features.items()))


def _run(models: list[str], cache: Path | None, **env: str) -> dict:
    """What `tests/isa_logits.py` prints, run with ``env`` set (and no inherited CPU choice),
    compiling into the numba cache folder ``cache`` (None: the project's own, as any run)."""
    full = {**os.environ, **env}
    for name in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", "NUMBA_CACHE_DIR"):
        if name not in env:
            full.pop(name, None)
    if cache is not None:
        full["NUMBA_CACHE_DIR"] = str(cache)
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "isa_logits.py"), *models], capture_output=True,
                          text=True, env=full, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


pytestmark = pytest.mark.xdist_group("instruction_sets")  # one worker: the native build runs once


@pytest.fixture(scope="module")
def native() -> dict:
    return _run([*TINY, "smollm2-135m"], None)


def test_an_avx2_build_gives_the_native_logits(native, tmp_path):
    host = llvm.get_host_cpu_features()
    if not (host.get("avx2") and host.get("fma")):
        pytest.skip("this CPU runs no AVX2 + FMA code")
    avx2 = _run([*TINY, "smollm2-135m"], tmp_path, NUMBA_CPU_NAME="znver3", NUMBA_CPU_FEATURES=_avx2_features())
    compiled = avx2["compiled"]
    assert compiled["cpu"] == "znver3" and "-avx512f" in compiled["features"]
    assert compiled["fma"] and "ymm" in compiled["registers"] and "zmm" not in compiled["registers"]
    assert max(compiled["register_numbers"]) < 16  # no EVEX-only register: AVX2 code
    assert compiled["weight_rows"] == 3  # and the 16-register layout: 3x4, remainder and few-rows blocks
    if host.get("avx512f"):  # the native build is AVX-512 code on the 4x4 / 8x2 layout
        assert "+avx512f" in native["compiled"]["features"] and native["compiled"]["weight_rows"] == 4
    assert avx2["logits"] == native["logits"]


def test_a_baseline_x86_64_build_gives_the_native_logits(native, tmp_path):
    generic = _run(TINY, tmp_path, NUMBA_CPU_NAME="generic")
    compiled = generic["compiled"]
    assert compiled["cpu"] == "generic" and not compiled["fma"] and compiled["registers"] == ["xmm"]
    assert compiled["weight_rows"] == 3
    assert generic["logits"] == {name: native["logits"][name] for name in TINY}


def test_a_build_that_reorders_a_sum_is_caught(native, tmp_path):
    """Negative control: the comparison can fail. A native build whose final sum adds the
    partial sums one after another (`isa_logits.py --reorder`) gives other logits."""
    moved = _run(["--reorder", "tiny-llama"], tmp_path)
    assert moved["logits"]["tiny-llama"] != native["logits"]["tiny-llama"]
