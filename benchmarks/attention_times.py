"""Attention kernel times alone: `ops.quad_attention` (and `ops.tree_attention`) on one layer's
shapes, for a chain of ``--rows`` nodes after ``--past`` cached keys, from any source tree, so
a change can be timed against a worktree of the commit before it, in turns:

    python benchmarks/attention_times.py --src ../old/src --label old
    python benchmarks/attention_times.py --label new

Defaults are SmolLM2-135M's (9 query heads, 3 kv heads, head size 64). Prints one JSON line:
numba's thread count read back, the median microseconds a call per row count (``--calls``
calls, ``--repeats`` times) and a digest of the outputs, which two trees with the same
arithmetic print alike. A step runs it once a layer, with K/V coming from further away than
here (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    parser.add_argument("--label", default="")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--past", type=int, default=128)
    parser.add_argument("--rows", default="1,4,8,12")
    parser.add_argument("--window", type=int, default=0, help="a sliding layer's window (0: none)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tree", action="store_true", help="time `tree_attention` too")
    args = parser.parse_args()
    sys.path.insert(0, args.src)
    import numba

    from recap.verifier.kernels import ops

    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    capacity = args.past + 64
    keys = rng.standard_normal((args.kv_heads, capacity, args.head_dim), dtype=np.float32)
    values = rng.standard_normal((args.kv_heads, capacity, args.head_dim), dtype=np.float32)
    quad = ops.QuadAttention(args.heads, args.kv_heads, args.head_dim)
    digest = hashlib.sha256()

    def median_us(kernel, *arguments) -> float:
        kernel(*arguments)
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            for _ in range(args.calls):
                kernel(*arguments)
            times.append((time.perf_counter() - started) / args.calls * 1e6)
        return round(statistics.median(times), 1)

    result: dict = {"label": args.label, "numba": numba.get_num_threads(), "quad_us": {}, "tree_us": {}}
    for rows in (int(r) for r in args.rows.split(",")):
        starts = np.concatenate([[0], np.cumsum(np.arange(1, rows + 1))]).astype(np.int64)
        paths = np.concatenate([np.arange(i + 1) for i in range(rows)]).astype(np.int64)  # a chain
        q = rng.standard_normal((rows, args.heads * args.head_dim), dtype=np.float32)
        out = np.zeros_like(q)
        plan = quad.plan(args.past, starts, rows)
        result["quad_us"][rows] = median_us(quad, plan, q, keys, values, paths, 0.125, out, args.window)
        digest.update(out.tobytes())
        if args.tree:
            result["tree_us"][rows] = median_us(ops.tree_attention, q, keys, values, args.past, starts, paths, 0.125,
                                                args.window, out, rows)
    result["outputs"] = digest.hexdigest()[:16]
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
