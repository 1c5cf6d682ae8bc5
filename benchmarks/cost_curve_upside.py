"""What a cheaper multi-row step would buy recap, before anyone writes the kernel.

    python benchmarks/cost_curve_upside.py --model smollm2-135m --weights stored --threads 1

Runs recap on MMSpec first turns (``--limit`` per topic, one stream per topic, greedy, 64 new
tokens) twice: drafting on this machine's measured cost profile P, and on a hypothetical
linear profile H (t(n) = t(1) + (n - 1) * slope; ``--slope-ms``, by default P's own
(t(4) - t(1)) / 3, i.e. no padding cliffs past 4 rows). Both profiles are frozen (no online
correction). It reports tau and the sizes verified, and prices each run's verifications under
both curves: the estimated step time per token under H when drafting on H, against P when
drafting on P, is the upside of making the real curve H. Host work and prefill are left out
(the same in both). Outputs are asserted identical to plain AR's.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--weights", default="stored")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data", default=None)
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--slope-ms", type=float, default=None, help="H's cost of each row past the first")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    import recap
    from recap.bench import data as bench_data
    from recap.bench.sources import resolve_data
    from recap.decoding import decode
    from recap.proposers import make_proposer
    from recap.verifier.kernels.threads import check_read_back, read_back

    items = bench_data.select(bench_data.load_items(resolve_data(args.data)), None, args.limit)
    units = [unit for unit in bench_data.units_of(items) if unit.turn == 0]
    target = recap.load(args.model, weights=args.weights)
    prompts = [target.prepare(bench_data.messages_for(unit, [])) for unit in units]
    measured = dataclasses.replace(target.verify_cost(), correction_rate=0.0)
    context = 256
    sizes = np.arange(1, 65)
    p_times = measured.predict(sizes, context)
    slope = args.slope_ms / 1000 if args.slope_ms is not None else (p_times[3] - p_times[0]) / 3
    h_times = p_times[0] + (sizes - 1) * slope
    linear = dataclasses.replace(measured, sizes=sizes.astype(float), contexts=[float(context)], times=[h_times],
                                 row_block=1)
    print(f"P(1..12) ms: {np.round(p_times[:12] * 1000, 1).tolist()}")
    print(f"H(1..12) ms: {np.round(h_times[:12] * 1000, 1).tolist()}")
    reference = [decode(target, make_proposer("ar"), p, max_new_tokens=args.max_new_tokens).tokens for p in prompts]

    def run(profile, label: str) -> None:
        target.use_cost_profile(profile)
        streams: dict = {}
        verified: collections.Counter = collections.Counter()
        tokens = 0
        for index, unit in enumerate(units):
            proposer = streams.setdefault(unit.topic, make_proposer("recap"))
            out = decode(target, proposer, prompts[index], max_new_tokens=args.max_new_tokens)
            assert out.tokens == reference[index], f"{label}: unit {unit.key} differs from AR"
            tokens += len(out.tokens)
            verified.update(it.draft_size + 1 for it in out.iterations)
        steps = sum(verified.values())
        on_p = sum(n * float(measured.predict(size, context)) for size, n in verified.items())
        on_h = sum(n * float(h_times[min(size, len(sizes)) - 1]) for size, n in verified.items())
        print(f"drafting on {label}: {tokens} tokens, {steps} steps, tau {tokens / steps:.2f}; step time per token "
              f"priced on P {on_p / tokens * 1000:.2f} ms, on H {on_h / tokens * 1000:.2f} ms; rows verified "
              f"{dict(sorted(verified.items()))}")

    run(measured, "P (measured)")
    run(linear, "H (linear)")
    ran = read_back(target.kernels)
    check_read_back(args.threads, ran, "the run")
    print(f"threads read back: {ran}")


if __name__ == "__main__":
    main()
