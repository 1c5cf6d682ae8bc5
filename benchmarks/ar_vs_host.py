"""AR decode time of one prompt over a pure-Python busy loop timed beside it, so two source
trees can be compared on a host whose speed drifts (a shared VM's can move 20% in minutes):

    PYTHONPATH=../old/src python benchmarks/ar_vs_host.py --label old
    python benchmarks/ar_vs_host.py --label new

Prints one JSON line: the median decode seconds and busy-loop seconds of ``--repeats`` runs
after two warm-up decodes, and their ratio (what to compare), at 1 thread (set and read back).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _busy() -> float:
    start, total = time.perf_counter(), 0
    for i in range(2_000_000):
        total += i
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="ar")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import numba
    import torch

    torch.set_num_threads(1)
    numba.set_num_threads(1)
    import recap
    from recap.decoding import decode
    from recap.proposers import make_proposer

    target = recap.load(args.model, dtype="float32")
    inputs = target.prepare("Describe a quiet harbour at dawn in three sentences.")
    for _ in range(2):
        decode(target, make_proposer(args.method), inputs, max_new_tokens=args.max_new_tokens)
    decodes, busy = [], []
    for _ in range(args.repeats):
        busy.append(_busy())
        start = time.perf_counter()
        result = decode(target, make_proposer(args.method), inputs, max_new_tokens=args.max_new_tokens)
        decodes.append(time.perf_counter() - start)
    seconds, control = statistics.median(decodes), statistics.median(busy)
    print(json.dumps({"label": args.label, "method": args.method, "tokens": len(result.tokens),
                      "decode_s": round(seconds, 4), "busy_s": round(control, 4),
                      "ratio": round(seconds / control, 3),
                      "threads": [torch.get_num_threads(), numba.get_num_threads()]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
