"""The thread count a caller asked for is the one that runs: no public entry point leaves
torch's count other than it found it, and the fast kernels run on exactly that many threads.

Each case runs in a fresh process, because the fault this guards against happens once per
process: numba's parallel pool, when it starts, sets the process's OpenMP thread count (which
torch reads as its own) to the core count. Once with recap starting the pool itself, once
with the caller's own numba code starting it first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from recap.errors import RecapError
from recap.verifier.kernels import threads

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import json, sys, threading
    import torch
    if sys.argv[1] == "pool-first":  # the caller's own numba code starts the pool first
        from numba.np.ufunc.parallel import _launch_threads
        _launch_threads()
    torch.set_num_threads(1)
    import recap
    from recap.serve.engine import Engine, Job
    from recap.serve.tenants import TenantStreams
    from recap.verifier.kernels.threads import kernel_threads
    from recap.verifier.profile import measure_profile
    seen = {}

    def note(entry):
        seen[entry] = {"torch": torch.get_num_threads(), "kernels": kernel_threads()}

    target = recap.load("tiny-llama", kernels="fast")
    note("load")
    recap.generate(target, "a b c", method="recap", max_new_tokens=6)
    note("generate")
    recap.generate_batch(target, ["a b", "c d"], method="sam", max_new_tokens=4)
    note("generate_batch")
    for _ in recap.Decoding(target, recap.make_proposer("pld"), target.prepare("a b c"), max_new_tokens=4):
        pass
    note("Decoding")
    measure_profile(target, sizes=(1, 2), contexts=(4,), repeats=1)
    note("measure_profile")
    done = threading.Event()
    engine = Engine(target, TenantStreams("recap", target.vocab_size))
    engine.submit(Job(tenant="t", inputs=target.prepare("a b c"), max_tokens=4,
                      emit=lambda event: event["type"] in ("done", "error") and done.set()))
    done.wait(120)
    engine.shutdown()
    seen["serve engine"] = {"torch": torch.get_num_threads(), "kernels": None}  # it decodes on its own thread
    from recap.demo import run_demo
    run_demo("tiny-llama", ("sam",), max_new_tokens=4, out=sys.argv[2], cost_profile="flat", memory=None)
    note("demo")
    print(json.dumps(seen))
''')


@pytest.mark.parametrize("start", ["recap-starts-the-pool", "pool-first"])
def test_every_entry_point_keeps_the_callers_thread_count(start, tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, start, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(seen) == ["load", "generate", "generate_batch", "Decoding", "measure_profile", "serve engine",
                          "demo"]
    for entry, counts in seen.items():
        assert counts["torch"] == 1, (entry, counts)
        assert counts["kernels"] in (1, None), (entry, counts)


def test_calibrate_profiles_say_and_time_the_threads_asked_for(tmp_path):
    """`recap calibrate --threads 1` in a fresh process: its profile is keyed 1 thread (the
    count read back after the measurement, or it would have been refused)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "RECAP_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "recap.cli", "calibrate", "--model", "tiny-llama", "--threads", "1",
                           "--quick", "--json"], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    key = json.loads(done.stdout.strip().splitlines()[-1])["profile"]["key"]
    assert key["threads"] == 1 and key["kernels"] == "fast"


def test_a_result_on_other_threads_than_asked_is_refused():
    threads.check_read_back(1, {"torch": 1, "kernels": 1}, "a run")
    threads.check_read_back(2, {"torch": 2, "kernels": None}, "a run")  # stock kernels: torch's count alone
    with pytest.raises(RecapError, match="asked for 1 thread.*kernels 2"):
        threads.check_read_back(1, {"torch": 1, "kernels": 2}, "a run")
    with pytest.raises(RecapError, match="torch 2"):
        threads.check_read_back(1, {"torch": 2, "kernels": 1}, "a run")
