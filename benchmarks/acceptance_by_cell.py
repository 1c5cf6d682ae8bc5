"""Acceptance of draft nodes by calibration cell, on held-out MMSpec items: where recap's priors come from.

Runs ``recap`` with the ``no-cost`` ablation (the best 63 candidates drafted every step, so
nearly every candidate's outcome is observed) on items 3..6 of each topic (never the first two,
which ``recap bench --limit 2`` uses), one stream per topic, and prints the observed
acceptance rate (given the parent accepted) per cell next to the prior:

    .venv/bin/python benchmarks/acceptance_by_cell.py [--items 3:7] [--max-new-tokens 64] [--threads 1]

Takes about 10 minutes with SmolLM2 fp32 on one thread of the 2-core machine.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import recap
from recap.bench import data as bench_data
from recap.core import calibration as cal
from recap.decoding import decode
from recap.proposers import make_proposer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--items", default="2:6", help="slice of each topic's items (0-based, default 2:6)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start, stop = (int(x) for x in args.items.split(":"))
    target = recap.load(args.model)
    by_topic: dict[str, list] = {}
    for item in bench_data.load_items(bench_data.mmspec_path(None)):
        by_topic.setdefault(item.topic, []).append(item)
    trials = accepts = None
    answers: dict[str, list[str]] = {}
    for items in by_topic.values():
        proposer = make_proposer("recap", ablation="no-cost")
        for unit in bench_data.units_of(items[start:stop]):
            messages = bench_data.messages_for(unit, answers.get(unit.item.id, []))
            result = decode(target, proposer, target.prepare(messages), max_new_tokens=args.max_new_tokens)
            text = target.tokenizer.decode(result.tokens, skip_special_tokens=True)
            answers.setdefault(unit.item.id, []).append(text)
            print(f"{unit.key}: tau {result.tau:.2f}", flush=True)
        c = proposer.calibrator
        trials = c.trials.copy() if trials is None else trials + c.trials
        accepts = c.accepts.copy() if accepts is None else accepts + c.accepts
    prior = cal.AcceptanceCalibrator().prior

    def cell(i: int) -> str:
        return f"{accepts[i] / trials[i]:.2f} ({int(trials[i])}) vs {prior[i]:.2f}" if trials[i] else "-"

    print("\nrecycled nodes: observed (labels) vs prior; rows depth 1, 2, 3, 4-5, 6+; columns q bins of 0.1")
    for depth_bucket in range(len(cal.DEPTH_EDGES) + 1):
        print(f"depth {depth_bucket}: " + " | ".join(cell(depth_bucket * cal.Q_BINS + b) for b in range(cal.Q_BINS)))
    lowest = np.concatenate([[1], cal.EVIDENCE_EDGES])
    buckets = [f"{a}-{b - 1}" if b - 1 > a else f"{a}" for a, b in zip(lowest[:-1], lowest[1:])] + [f"{lowest[-1]}+"]
    for source, name in ((cal.REQUEST, "request"), (cal.STORE, "store")):
        for opening in (False, True):
            print(f"\n{name} continuations{' (opening chains)' if opening else ''}: rows evidence (matched "
                  "tokens) buckets; columns first token | later tokens")
            for bucket, evidence in enumerate(lowest):
                first = int(cal.continuation_cells(source, int(evidence), np.array([1]), opening)[0])
                later = first + 1  # the bucket's later-token cell sits right after its first-token cell
                print(f"evidence {buckets[bucket]}: {cell(first)} | {cell(later)}")


if __name__ == "__main__":
    main()
