"""Cost of verifying N tree tokens relative to one token (the AR step), per dtype.

This decides tree budgets: a drafter pays off only when tau exceeds this ratio.

    .venv/bin/python benchmarks/verify_cost.py --model smollm2-135m --dtypes float32,bfloat16 --threads 1

Method: one prompt (~256 tokens) is prefilled, then trees of N packed nodes (root + N-1
random-shape nodes) are verified and committed (root only) in the target's measuring
session (`TargetModel.measuring`, which restores the cache after each); every N is measured
`--repeats` times in an interleaved order after a warm-up, and the median time is divided by
the median at N = 1.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch

import recap
from recap.core import ROOT, DraftTree
from recap.verifier.profile import measuring


def random_tree(nodes: int, rng: np.random.Generator, vocab: int) -> DraftTree:
    parents = [ROOT if i == 0 else int(rng.integers(-1, i)) for i in range(nodes)]
    return DraftTree(rng.integers(0, vocab, nodes), parents)


def measure(model: str, dtype: str, sizes: list[int], repeats: int, prompt_tokens: int) -> dict[int, float]:
    target = recap.load(model, dtype=dtype)
    rng = np.random.default_rng(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "while", "cat", "sleeps", "in", "sun"]
    prompt = " ".join(words[i % len(words)] for i in range(prompt_tokens))
    ids = target.prepare(prompt).input_ids[0].numpy()
    trees = {n: random_tree(n - 1, rng, target.vocab_size) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    with measuring(target, ids) as session:
        for round_index in range(repeats + 1):  # round 0 is the warm-up
            for n in rng.permutation(sizes):
                start = time.perf_counter()
                session.step(trees[int(n)])  # verify, then commit the root
                elapsed = time.perf_counter() - start
                session.restore()
                if round_index:
                    times[int(n)].append(elapsed)
    return {n: statistics.median(t) for n, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--sizes", default="1,4,8,16,32,64")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {"model": args.model, "threads": torch.get_num_threads(), "torch": torch.__version__,
               "cpu": platform.processor() or platform.machine(), "repeats": args.repeats, "dtypes": {}}
    print(f"{args.model}, {results['threads']} thread(s), median of {args.repeats} after warm-up")
    print(f"{'dtype':>9} " + " ".join(f"{'N=' + str(n):>14}" for n in sizes))
    for dtype in args.dtypes.split(","):
        medians = measure(args.model, dtype, sizes, args.repeats, args.prompt_tokens)
        base = medians[sizes[0]]
        results["dtypes"][dtype] = {str(n): {"ms": medians[n] * 1e3, "ratio": medians[n] / base} for n in sizes}
        print(f"{dtype:>9} " + " ".join(f"{medians[n] * 1e3:7.1f}ms {medians[n] / base:4.2f}x" for n in sizes))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
