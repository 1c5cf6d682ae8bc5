"""Host-side overhead per decoding iteration (propose, packing, observe), with no model.

    .venv/bin/python benchmarks/overhead.py --method recap --vocab 49152,152064 --budget 63
    .venv/bin/python benchmarks/overhead.py --method recap --vocab 152064 --profile

A seeded synthetic language (`recap.overhead.SyntheticTarget`) replaces the model, so only the
drafter's CPU work and the tree packing are timed; see `recap.overhead.run_overhead`.
"""

from __future__ import annotations

import argparse
import json

from recap.overhead import format_overhead, profile_overhead, run_overhead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="recap")
    parser.add_argument("--vocab", default="49152", help="comma-separated vocabulary sizes")
    parser.add_argument("--budget", type=int, default=63)
    parser.add_argument("--requests", type=int, default=8, help="counted requests (one warm-up runs before)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the raw result dicts as JSON")
    parser.add_argument("--profile", action="store_true", help="cProfile the proposer instead of timing it")
    args = parser.parse_args()
    for vocab in (int(v) for v in args.vocab.split(",")):
        options = {"vocab": vocab, "budget": args.budget, "requests": args.requests,
                   "max_new_tokens": args.max_new_tokens, "seed": args.seed}
        if args.profile:
            print(f"== {args.method} vocab={vocab} budget={args.budget}: cProfile of propose + observe")
            print(profile_overhead(args.method, **options))
            continue
        result = run_overhead(args.method, **options)
        print(json.dumps(result) if args.json else format_overhead(result) + "\n")


if __name__ == "__main__":
    main()
