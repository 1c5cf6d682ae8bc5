"""How well a measured cost profile predicts verify times it was not measured at.

    .venv/bin/python benchmarks/verify_cost_model.py --model smollm2-135m --threads 1

Method: `measure_profile` measures the grid `recap calibrate` measures (sizes 1..128 at
contexts 128 and 1024; --quick: the lazy path's grid), then other trees (another seed) are
timed the same way (verify + commit, median of --repeats) at off-grid sizes and context
lengths, and compared with the profile's interpolated prediction. Contexts outside the
profile's range (64 here) test its extrapolation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

import recap
from recap.verifier.profile import measure_profile, measure_times


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="predict from the quick (lazy-path) profile")
    parser.add_argument("--sizes", default="5,10,20,40,80", help="packed tokens, root included")
    parser.add_argument("--contexts", default="64,300,700")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = recap.load(args.model, dtype=args.dtype)
    sizes, contexts = _ints(args.sizes), _ints(args.contexts)

    started = time.perf_counter()
    profile = measure_profile(target, quick=args.quick)
    profile_s = time.perf_counter() - started
    measured = measure_times(target, sizes, contexts, args.repeats, seed=1)

    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} thread(s), {profile.key['cpu']}; profile "
          f"({'quick' if args.quick else 'full'}: sizes {profile.sizes.astype(int).tolist()}, contexts "
          f"{profile.contexts.astype(int).tolist()}) measured in {profile_s:.1f} s; test points: median of "
          f"{args.repeats}")
    print(f"{'L':>5} {'N':>4} {'predicted ms':>13} {'measured ms':>12} {'rel. error':>11}")
    errors, rows = [], []
    for c, context in enumerate(contexts):
        predicted = profile.predict(sizes, context)
        for s, n in enumerate(sizes):
            error = (predicted[s] - measured[c, s]) / measured[c, s]
            errors.append(abs(error))
            rows.append({"context": context, "size": n, "predicted_ms": predicted[s] * 1e3,
                         "measured_ms": measured[c, s] * 1e3, "relative_error": error})
            print(f"{context:>5} {n:>4} {predicted[s] * 1e3:>13.1f} {measured[c, s] * 1e3:>12.1f} {error:>+10.1%}")
    print(f"relative error |predicted - measured| / measured: median {statistics.median(errors):.1%}, "
          f"max {max(errors):.1%} over {len(errors)} points")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
                       "profile": profile.to_dict(), "points": rows,
                       "median_abs_error": float(np.median(errors)), "max_abs_error": float(max(errors))},
                      handle, indent=1)


if __name__ == "__main__":
    main()
