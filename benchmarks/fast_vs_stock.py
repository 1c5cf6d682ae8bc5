"""How often greedy decoding on the fast kernels agrees with stock ``model.generate``.

    python benchmarks/fast_vs_stock.py --model smollm2-135m --prompts 30 --max-new-tokens 48

The fast path is exact against plain decoding on its own kernels (tested bit for bit); against
stock transformers it is an agreement rate: a near-tie can round the other way. For every
prompt whose outputs differ, the first differing position and the stock logit gap there
(top-1 minus the fast path's token; text prompts) are listed, so one can see the flips are near-ties.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import recap  # noqa: E402
from recap.decoding import reference_generate  # noqa: E402
from recap.prompts import check_prompts  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = recap.load(args.model, dtype=args.dtype, kernels="fast")
    differences = []
    items = list(check_prompts(args.prompts, images=target.accepts_images))
    for index, (prompt, image) in enumerate(items):
        inputs = target.prepare(prompt, image)
        fast = reference_generate(target, inputs, args.max_new_tokens)
        stock = target.stock_generate(inputs, args.max_new_tokens)
        if fast == stock:
            continue
        at = next((i for i, (a, b) in enumerate(zip(fast, stock)) if a != b), min(len(fast), len(stock)))
        gap = None
        if at < min(len(fast), len(stock)) and not inputs.extra:  # text prompts: one plain stock forward
            with torch.inference_mode():
                logits = target.model(input_ids=torch.tensor([inputs.prompt_ids + stock[:at]])).logits[0, -1]
            gap = float(logits[stock[at]] - logits[fast[at]])
        differences.append({"prompt": index, "first_difference": at, "stock_logit_gap": gap})
    agree = len(items) - len(differences)
    print(f"{args.model} {args.dtype}: {agree} of {len(items)} outputs identical to stock generate "
          f"({args.max_new_tokens} new tokens at most)")
    for d in differences:
        gap = "n/a" if d["stock_logit_gap"] is None else f"{d['stock_logit_gap']:.2e}"
        print(f"  prompt {d['prompt']}: first difference at token {d['first_difference']}, stock logit gap {gap}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "prompts": len(items), "identical": agree,
                                               "differences": differences}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
