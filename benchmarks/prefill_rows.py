"""What a prefill costs by the prompt rows it computes Top-K for (`recap.core.RowsWanted`):
``all`` (every row: what RECAP's prefill ran before it declared ``first``), ``first`` (each
eligible token's first row and the last: RECAP, tree recycling) and ``none`` (the last row:
AR, PLD, SAM, lookahead, token recycling).

    python benchmarks/prefill_rows.py --model recap-demo-vlm --threads 1
    python benchmarks/prefill_rows.py --model smollm2-135m --threads 1 --prompts 16

Prompts: the demo VLM's held-out scenes ("Describe the image.", as `make demo` asks) on an
image model, else the first --prompts MMSpec units' text (`../shared/data/mmspec`, chat
template and system prompt as `recap bench` builds them; earlier answers stand in as a
fixed sentence). One untimed pass, then --repeats passes; within a pass each prompt runs the
three choices in turn, the prefix cache cleared before every prefill. Reported per choice:
the median over passes of the summed prefill time, the rows whose logits were computed, and
the ratio to ``all`` from the same run. The thread count is pinned and printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import recap  # noqa: E402
from recap.core import NOT_COMPUTED  # noqa: E402

CHOICES = ("all", "first", "none")


def prompts(target, count: int) -> list:
    if target.accepts_images:
        from recap.demo import demo_inputs

        out = Path("prefill-rows-out")
        return [target.prepare(item.question, item.image) for item in demo_inputs(target, out)][:count]
    from recap.bench.data import load_items, messages_for, mmspec_path, units_of

    units = units_of(load_items(mmspec_path("mmspec")))[:count]
    filler = "An earlier answer, a sentence or two long, that the next turn builds on."
    return [target.prepare(messages_for(unit, [filler] * unit.turn), None) for unit in units]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="recap-demo-vlm")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = recap.load(args.model)
    inputs = prompts(target, args.prompts)
    totals = {choice: [] for choice in CHOICES}
    rows = dict.fromkeys(CHOICES, 0)
    length = sum(target.prompt_length(x) for x in inputs)
    for repeat in range(args.repeats + 1):
        spent = dict.fromkeys(CHOICES, 0.0)
        for x in inputs:
            for choice in CHOICES:
                target.prefix_cache.clear()
                target.keep_prompt_rows(choice)
                start = time.perf_counter()
                prompt, _ = target.prefill(x)
                spent[choice] += time.perf_counter() - start
                target.release()
                if repeat == 0:
                    computed = np.count_nonzero(prompt.topk_ids[:, 0] != NOT_COMPUTED)
                    rows[choice] += 1 if choice == "none" else int(computed)
        if repeat:
            for choice in CHOICES:
                totals[choice].append(spent[choice])
    medians = {choice: statistics.median(times) for choice, times in totals.items()}
    print(f"{args.model}, {target.kernels} kernels, {torch.get_num_threads()} thread(s), {len(inputs)} prompts, "
          f"{length} prompt rows, median of {args.repeats} passes")
    print("| rows wanted | rows with logits | prefill ms (all prompts) | vs all |")
    print("| --- | --- | --- | --- |")
    for choice in CHOICES:
        print(f"| {choice} | {rows[choice]} | {medians[choice] * 1e3:.1f} | {medians[choice] / medians['all']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "kernels": target.kernels, "threads": args.threads,
                                         "prompts": len(inputs), "prompt_rows": length, "rows": rows,
                                         "median_s": medians, "passes": totals}, indent=1))


if __name__ == "__main__":
    main()
