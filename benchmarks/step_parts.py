"""Where one fast step's time goes: linear layers by role, attention, the small ops, and the
rest (Python between the kernels), for a step of ``--rows`` rows after 128 cached tokens.

    python benchmarks/step_parts.py --model smollm2-135m --weights stored --threads 1 --rows 1

Each kernel call is wrapped in a timer (about a microsecond each, counted in its part), so
the parts add up to a little more than an unwrapped step; the unwrapped step is printed too.
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--weights", default="stored")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    import recap
    from recap.verifier.kernels import ops
    from recap.verifier.kernels.threads import check_read_back, read_back

    target = recap.load(args.model, weights=args.weights, kernels="fast")
    decoder = target.decoder
    cache, past = decoder.new_cache(128 + args.rows + 8), 128
    decoder.forward(cache, np.full(past, 5, np.int64), np.arange(past), np.arange(past + 1), np.arange(past))
    cache.commit(np.arange(past))
    m = args.rows
    step = (np.full(m, 7, np.int64), np.arange(past, past + m), np.arange(m + 1), np.arange(m))

    def timed_step() -> float:
        started = time.perf_counter()
        for _ in range(args.repeats):
            decoder.forward(cache, *step)
        return (time.perf_counter() - started) / args.repeats

    for _ in range(3):
        decoder.forward(cache, *step)
    plain = timed_step()
    spent: collections.Counter = collections.Counter()
    roles = {id(decoder.head): "linear head"}
    for layer in decoder.layers:
        roles.update((id(getattr(layer, role)), f"linear {role}")
                     for role in ("q", "k", "v", "o", "gate", "up", "down"))

    timing = [False]  # a call made inside a timed one (a layer of q+k+v past 2 rows) is counted there

    def wrap(owner, name: str, label) -> None:
        inner = getattr(owner, name)

        def timed(*a, **k):
            if timing[0]:
                return inner(*a, **k)
            timing[0], started = True, time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[label(a)] += time.perf_counter() - started
                timing[0] = False
        setattr(owner, name, timed)

    for name in ("rms_norm", "add_rms_norm", "rope", "write_cache", "tree_attention", "silu_mul", "gelu_tanh_mul"):
        wrap(ops, name, lambda a, name=name: name)
    for layer in decoder.layers:
        roles.update({id(layer.qkv): "linear q+k+v", id(layer.gate_up): "linear gate+up"})
    for kind in (type(decoder.layers[0].q), type(decoder.layers[0].qkv)):
        wrap(kind, "__call__", lambda a: roles.get(id(a[0]), "linear other"))
    if decoder.quad_attention is not None:
        wrap(type(decoder.quad_attention), "__call__", lambda a: "attention (quad)")
    total = timed_step()
    print(f"{args.model} ({target.weights}), {m} row(s), threads read back {read_back(target.kernels)}: "
          f"step {plain * 1000:.2f} ms unwrapped, {total * 1000:.2f} ms wrapped")
    for label, seconds in spent.most_common():
        print(f"  {label:18s} {seconds / args.repeats * 1000:7.3f} ms")
    print(f"  {'rest':18s} {(total - sum(spent.values()) / args.repeats) * 1000:7.3f} ms")
    check_read_back(args.threads, read_back(target.kernels), "the run")


if __name__ == "__main__":
    main()
