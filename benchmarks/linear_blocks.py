"""Which register block of the fast linear kernel suits this CPU (`recap.verifier.kernels.linear`).

Times every linear layer of a decoder's shapes (SmolLM2-135M's by default: 30 layers of
q/k/v/o and gate/up/down, K = 576 / 1536) once per step, for each row count, on the 4x4 block
(with the 8x2 block for 2 rows and the 16x1 block for 1) and on the 3x4 block, interleaved in one process so drift
hits both alike; random float32 weights of the model's shapes, distinct per layer, so they
stream from memory as a real step's do. Prints the median of ``--repeats`` passes per block
and row count, the ratio, and whether the two blocks gave the same bits.

    python benchmarks/linear_blocks.py --threads 1 --rows 1,2,4,8,16,32,64

`linear.WEIGHT_ROWS` is what the kernels pick on this machine without being asked.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np

from recap.bench.environment import cpu_model
from recap.verifier.kernels import linear


def smollm2_shapes(layers: int = 30, hidden: int = 576, kv: int = 192, inter: int = 1536) -> list[tuple[int, int]]:
    """(out_features, in_features) of every linear layer a step runs (the head left out)."""
    one = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
           (hidden, inter)]
    return one * layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    numba.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    shapes = smollm2_shapes()
    weights = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
    padded = max(linear.padded_rows(max(rows)), linear.ROW_BLOCK)
    inputs = {k: rng.standard_normal((padded, k), dtype=np.float32) for k in {k for _, k in shapes}}
    blocks = {rows_: [linear.Linear(w, None, weight_rows=rows_) for w in weights] for rows_ in (4, 3)}
    outputs = {rows_: {n: np.zeros((padded, n), np.float32) for n in {n for n, _ in shapes}} for rows_ in blocks}

    def step(block: int, m: int) -> None:
        for layer in blocks[block]:  # a layer without the 2-row block computes 2 rows as 4 itself
            layer(inputs[layer.in_features], outputs[block][layer.out_features], linear.padded_rows(m))

    times: dict[tuple[int, int], list[float]] = {(b, m): [] for b in blocks for m in rows}
    for m in rows:  # compile and warm
        for b in blocks:
            step(b, m)
    for _ in range(args.repeats):
        for m in rows:
            for b in blocks:
                start = time.perf_counter()
                step(b, m)
                times[b, m].append(time.perf_counter() - start)
    same = all(np.array_equal(outputs[4][n][:max(rows)], outputs[3][n][:max(rows)]) for n in outputs[4])
    macs = sum(n * k for n, k in shapes)
    print(f"cpu {cpu_model()}, {args.threads} thread(s), WEIGHT_ROWS here = {linear.WEIGHT_ROWS}, "
          f"median of {args.repeats}, ms for all {len(shapes)} layers")
    print(f"{'rows':>5} {'4x4 (8x2, 16x1)':>16} {'3x4':>8} {'3x4 / 4x4':>10} {'3x4 GMAC/s':>11}")
    for m in rows:
        four, three = (statistics.median(times[b, m]) for b in (4, 3))
        print(f"{m:5d} {four * 1e3:16.1f} {three * 1e3:8.1f} {three / four:10.2f} {m * macs / three / 1e9:11.1f}")
    print(f"same bits on both blocks: {same}")


if __name__ == "__main__":
    main()
