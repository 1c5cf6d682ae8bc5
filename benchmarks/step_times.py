"""Whole fast-kernel step times of SmolLM2 for a few packed sizes, from any source tree, so
two trees (the commit before a kernel change, in a git worktree, and this one) can be timed
in turns, one process each:

    NUMBA_NUM_THREADS=1 python benchmarks/step_times.py --src ../old/src --label old
    NUMBA_NUM_THREADS=1 python benchmarks/step_times.py --label new
    python benchmarks/step_times.py --weights stored   # GGUF blocks read as stored (issue 45)

Prints one JSON line: the thread counts read back (torch's, numba's), load seconds (compile
included on a cold numba cache) and the median ms of ``--repeats`` verify + commit steps per
size after 128 cached tokens (`recap.verifier.profile.measure_times`). Set
``NUMBA_NUM_THREADS=1`` for trees older than issue 44, whose "1 thread" ran on 2; compare
trees as ratios of interleaved runs, never against a figure from another session.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    parser.add_argument("--label", default="")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sizes", default="1,2,4,5,8")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--weights", default="", help="stored or float (trees since issue 45)")
    args = parser.parse_args()
    sys.path.insert(0, args.src)
    import numba
    import torch

    torch.set_num_threads(args.threads)
    import recap
    from recap.verifier.profile import measure_times

    started = time.perf_counter()
    options = {"weights": args.weights} if args.weights else {}
    target = recap.load(args.model, kernels="fast", **options)
    loaded = time.perf_counter() - started
    sizes = [int(size) for size in args.sizes.split(",")]
    times = measure_times(target, sizes, [args.context], args.repeats, warmup=True)
    print(json.dumps({"label": args.label, "weights": getattr(target, "weights", "float"),
                      "torch": torch.get_num_threads(), "numba": numba.get_num_threads(),
                      "load_s": round(loaded, 1),
                      "ms": {size: round(float(t) * 1e3, 2) for size, t in zip(sizes, times[0])}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
