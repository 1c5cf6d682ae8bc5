"""Where a batch's time goes: `recap.generate_batch` over MMSpec first turns (the prompts of
`serve_load.py`; ``--model recap-demo-vlm``: held-out demo scenes, "Describe the image."),
split into forward (verify) and host seconds, with rows per step, prompt rows (after
prefix-cache reuse) per request, and the median / P95 / longest step, for each ``--max-batch``.

    .venv/bin/python benchmarks/batch_profile.py --model smollm2-135m --max-batch 1,8
    .venv/bin/python benchmarks/batch_profile.py --model recap-demo-vlm --max-batch 4 --requests 12

Method: one untimed warm-up batch of 8 other prompts, then ``--requests`` prompts per setting, the
thread count pinned (printed). The rows per request bound what batching can reach: a request
costs at least its prompt rows plus one row per token after the first (docs/serve.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numba
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_load  # noqa: E402

from recap import batching, generate_batch  # noqa: E402
from recap.models import load  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="recap")
    parser.add_argument("--max-batch", default="1,8", help="comma-separated batch caps")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    target = load(args.model, dtype="float32")
    if args.model == "recap-demo-vlm":
        from recap.demo_vlm.scenes import HELD_OUT_START, make_example

        prompts = ["Describe the image."] * (8 + args.requests)
        images = [make_example(HELD_OUT_START + i).image() for i in range(8 + args.requests)]
    else:
        prompts, images = serve_load._mmspec_messages(8 + args.requests), [None] * (8 + args.requests)
    steps: list[float] = []
    step = batching.Batch.step

    def timed_step(self):
        start = time.perf_counter()
        try:
            return step(self)
        finally:
            steps.append(time.perf_counter() - start)

    batching.Batch.step = timed_step
    spent = {"forward_s": 0.0, "steps": 0, "rows": 0, "prompt_rows": 0}
    verify = batching.verify_batch

    def timed(batch):
        start = time.perf_counter()
        try:
            return verify(batch)
        finally:
            spent["forward_s"] += time.perf_counter() - start
            spent["steps"] += 1
            spent["rows"] += batch.packed
            spent["prompt_rows"] += batch.prefill_rows

    batching.verify_batch = timed
    print(f"model {args.model}, method {args.method}, {args.threads} thread(s), {args.requests} requests, "
          f"{args.max_new_tokens} new tokens at most")
    generate_batch(target, prompts[:8], images=images[:8], method=args.method, max_new_tokens=args.max_new_tokens,
                   progress=False)
    for cap in (int(c) for c in args.max_batch.split(",")):
        spent.update(forward_s=0.0, steps=0, rows=0, prompt_rows=0)
        steps.clear()
        target.prefix_cache.clear()  # each setting prefills the timed prompts afresh
        start = time.perf_counter()
        results = generate_batch(target, prompts[8:], images=images[8:], method=args.method,
                                 max_new_tokens=args.max_new_tokens, max_batch=cap, progress=False)
        wall = time.perf_counter() - start
        tokens, requests = sum(len(r.tokens) for r in results), len(results)
        forward, rows, prompt_rows = spent["forward_s"], spent["rows"], spent["prompt_rows"]
        print(f"max batch {cap}: {tokens / wall:.1f} tok/s ({wall:.2f} s, {tokens} tokens); forward {forward:.2f} s, "
              f"host {wall - forward:.2f} s; {spent['steps']} steps, {rows / spent['steps']:.1f} rows/step, "
              f"{forward / rows * 1000:.2f} ms/row; per request {prompt_rows / requests:.1f} prompt rows, "
              f"{(rows - prompt_rows) / requests:.1f} decode rows, {tokens / requests:.1f} tokens; step median "
              f"{1000 * statistics.median(steps):.0f} ms, P95 {1000 * sorted(steps)[int(0.95 * len(steps))]:.0f} ms, "
              f"longest {1000 * max(steps):.0f} ms")


if __name__ == "__main__":
    main()
