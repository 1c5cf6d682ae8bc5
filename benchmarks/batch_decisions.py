"""What a batch's drafting decisions are worth, free of timing noise: `recap.generate_batch`
over MMSpec first turns (the prompts of `serve_load.py`) with a frozen copy of the machine's
cost profile and a constant host time per step, so every run makes the same choices; each
step is then priced by that profile, t(rows) + host, and the report gives steps, rows, the
nodes drafted on steps that carry prompt chunks, accepted drafts and predicted tokens/s.

Why: on a shared VM a batch run's wall clock moves by 10-25% between runs minutes apart
(docs/measurements.md, 2026-12-05), more than most changes to the chooser are worth. This
compares chooser changes (and `--batch-budget each` against the shared budget) exactly;
confirm a winner by wall clock afterwards (`batch_profile.py`, interleaved pairs).

    python benchmarks/batch_decisions.py --methods recap,recap:each,ar --max-batch 8
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import numba
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_load  # noqa: E402

from recap import batching, generate_batch  # noqa: E402
from recap.models import load  # noqa: E402


class _Ledger:
    """Per-step rows and predicted time of the batch's forwards."""

    def __init__(self, cost, host_s: float):
        self.cost, self.host_s = cost, host_s
        self.clear()

    def clear(self) -> None:
        self.steps = self.rows = self.prompt_rows = self.chunk_steps = self.chunk_nodes = 0
        self.seconds = 0.0

    def verify(self, real):
        def priced(batch):
            prompt, rows = batch.prefill_rows, batch.packed
            nodes = rows - prompt - len(batch.requests)
            context = sum(r.target.past_len for r in batch.requests) // max(1, len(batch.requests))
            self.steps += 1
            self.rows += rows
            self.prompt_rows += prompt
            if prompt:
                self.chunk_steps += 1
                self.chunk_nodes += nodes
            self.seconds += float(self.cost.predict(rows, context)) + self.host_s
            return real(batch)
        return priced


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default="recap,recap:each,ar",
                        help="comma-separated; NAME:each sizes NAME's trees per request (--batch-budget each)")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--host-ms", type=float, default=3.0, help="host time charged per step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    target = load(args.model, dtype="float32")
    cost = copy.deepcopy(target.verify_cost())
    cost.correction_rate = 0.0  # frozen: no step's measured time changes a later choice
    target.use_cost_profile(cost)
    host_s = args.host_ms / 1000
    ledger = _Ledger(cost, host_s)
    batching.verify_batch = ledger.verify(batching.verify_batch)
    step = batching.Batch.step

    def fixed_host(self):
        self.host_s = host_s
        return step(self)

    batching.Batch.step = fixed_host
    prompts = serve_load._mmspec_messages(8 + args.requests)[8:]  # batch_profile.py's timed prompts
    print(f"model {args.model}, {args.requests} requests, max batch {args.max_batch}, {args.max_new_tokens} new "
          f"tokens at most, frozen profile ({cost.source}), {args.host_ms:g} ms host per step; 1 thread")
    print("| method | steps | rows (prompt) | nodes on chunk steps | accepted drafts | predicted s | predicted tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    outputs = {}
    for spec in args.methods.split(","):
        method, _, budget = spec.partition(":")
        ledger.clear()
        target.prefix_cache.clear()
        results = generate_batch(target, prompts, method=method, max_new_tokens=args.max_new_tokens,
                                 max_batch=args.max_batch, shared_budget=budget != "each", progress=False)
        tokens = sum(len(r.tokens) for r in results)
        accepted = sum(it.accepted for r in results for it in r.iterations)
        outputs[spec] = [r.tokens for r in results]
        print(f"| {spec} | {ledger.steps} | {ledger.rows} ({ledger.prompt_rows}) | {ledger.chunk_nodes} on "
              f"{ledger.chunk_steps} | {accepted} | {ledger.seconds:.2f} | {tokens / ledger.seconds:.1f} |", flush=True)
    first = next(iter(outputs.values()))
    same = all(tokens == first for tokens in outputs.values())
    print(f"\nevery method's answers identical: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
