"""A GGUF whose float weights a small machine would not want: loaded without its float copy
and decoded from the file's blocks, with the memory that took (issue 45).

Writes (once, then reuses) a random-weight Llama of about 1.56 B parameters in a Q4_K_M-like
mix (`recap.verifier.kernels.random_gguf`: Q4_K, Q6_K for v, down and the tied embedding;
about 1 GB), then, in a fresh process per thread count, loads it with
``recap.load(path, float_copy=False)`` and greedy-decodes a prompt on the fast kernels:

    python benchmarks/big_gguf.py                      # 1 and 2 threads
    python benchmarks/big_gguf.py --threads 1 --tokens 32 --json big.json

Each process reports: resident memory after ``import recap`` (the baseline: torch, numba),
after loading, and its peak (``VmHWM``), the file's size, what the float copy would have
taken (4 bytes a weight), whether ``float_copy=None`` would have built it here, load
seconds (compile included on a cold numba cache), and decode tokens/s (median of
``--repeats`` runs after a warm-up, prefill included; the thread counts read back after them). Timings on
random weights: what a step costs, not what drafting would gain (random text has nothing
to recycle), so plain AR only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPE = {"architecture": "llama", "hidden": 2048, "layers": 24, "heads": 16, "kv_heads": 4,
         "intermediate": 8192, "tied": True}
"""Llama-3.2-like attention (GQA 4:1) and SmolLM2-1.7B's width, depth and MLP."""


def _resident(field: str = "VmRSS") -> int:
    """This process's resident bytes (``VmRSS``) or their peak (``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(path: Path, threads: int, tokens: int, repeats: int) -> dict:
    """One process's load and decode (run through ``--measure`` in a fresh interpreter)."""
    import torch

    torch.set_num_threads(threads)
    import recap
    from recap.models import available_memory
    from recap.verifier.kernels.stored import float_bytes
    from recap.verifier.kernels.threads import read_back

    baseline = _resident()
    started = time.perf_counter()
    target = recap.load(path, float_copy=False)
    loaded_s = time.perf_counter() - started
    after_load = _resident()
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    recap.generate(target, prompt, method="ar", max_new_tokens=4)  # warm-up
    rates = []
    for _ in range(repeats):
        result = recap.generate(target, prompt, method="ar", max_new_tokens=tokens)
        rates.append(result.tokens_per_s)
    ran = read_back(target.kernels)
    floats = float_bytes(path)
    return {"threads_asked": threads, "threads_ran": ran, "kernels": target.kernels, "weights": target.weights,
            "float_copy": target.float_copy, "parameters": target.parameter_count,
            "file_bytes": path.stat().st_size, "float_bytes": floats,
            "auto_would_build_floats": 2 * floats <= available_memory(),
            "rss_after_import": baseline, "rss_after_load": after_load, "peak_rss": _resident("VmHWM"),
            "load_s": round(loaded_s, 1), "tokens": tokens, "tokens_per_s": round(statistics.median(rates), 2),
            "runs": [round(rate, 2) for rate in rates]}


def _gb(value: int) -> str:
    return f"{value / 1e9:.2f} GB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=Path, default=None,
                        help="where the random model is written (default: recap's cache folder)")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from recap.models import cache_dir

    path = args.file or cache_dir() / "bench" / "random-llama-1.56b-q4_k_m.gguf"
    if args.measure:
        print(json.dumps(measure(path, int(args.threads), args.tokens, args.repeats)))
        return 0
    from recap.verifier.kernels import random_gguf

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} (random weights, once) ...", flush=True)
        partial = path.with_suffix(".partial")
        random_gguf.write(partial, random_gguf.Shape(**SHAPE), seed=0)
        partial.rename(path)
    rows = []
    for threads in [int(count) for count in args.threads.split(",")]:
        run = subprocess.run([sys.executable, __file__, "--measure", "--file", str(path), "--threads", str(threads),
                              "--tokens", str(args.tokens), "--repeats", str(args.repeats)],
                             capture_output=True, text=True)
        if run.returncode:
            sys.stderr.write(run.stderr)
            return run.returncode
        row = json.loads(run.stdout.strip().splitlines()[-1])
        if row["threads_ran"]["kernels"] != threads or row["threads_ran"]["torch"] != threads:
            sys.stderr.write(f"asked for {threads} thread(s), ran on {row['threads_ran']}: not reported\n")
            return 1
        rows.append(row)
    first = rows[0]
    print(f"\n{path.name}: {first['parameters'] / 1e9:.2f} B parameters, file {_gb(first['file_bytes'])}, "
          f"float32 copy would be {_gb(first['float_bytes'])} "
          f"(float_copy=None {'would' if first['auto_would_build_floats'] else 'would not'} build it here)\n")
    print("| threads | RSS after import | after load | peak | peak - import | / file | load s | AR tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        grown = row["peak_rss"] - row["rss_after_import"]
        print(f"| {row['threads_asked']} | {_gb(row['rss_after_import'])} | {_gb(row['rss_after_load'])} | "
              f"{_gb(row['peak_rss'])} | {_gb(grown)} | {grown / row['file_bytes']:.2f}x | {row['load_s']} | "
              f"{row['tokens_per_s']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
