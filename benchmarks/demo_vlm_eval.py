"""The demo VLM's model-card numbers, on held-out seeds (never used in training).

    .venv/bin/python benchmarks/demo_vlm_eval.py --items 200 --out out/demo-vlm-eval.json

1. Accuracy of greedy answers/captions by attribute (background, count, colour, first-object
   shape, position, chart values).
2. Image dependence: with the image of another held-out item swapped in, how often the first
   generated content token and the whole output change; the answer's loss with the own image
   vs the swapped one.
3. Condition aliasing (`recap.demo_vlm.aliasing`): recall of the greedy token from rows
   computed under the same image vs under other images, for 1-, 2- and 3-token keys; and
   RECAP's tau with request-local C/G vs the ``persistent-CG`` ablation over one stream.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

import recap
from recap.demo_vlm import aliasing, evaluate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--swap-items", type=int, default=100)
    parser.add_argument("--alias-items", type=int, default=60)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = recap.load("recap-demo-vlm")
    examples = evaluate.held_out(args.items)
    results: dict = {"items": args.items, "threads": args.threads, "max_new_tokens": args.max_new_tokens}

    outputs, scores = [], []
    for example in tqdm(examples, desc="held-out answers"):
        result = recap.generate(target, example.question, image=example.image(), max_new_tokens=args.max_new_tokens)
        outputs.append(result)
        scores.append(evaluate.score(example, result.text))
    accuracy = evaluate.accuracy(scores)
    results["accuracy"] = {k: {"correct": c, "total": t, "rate": c / t} for k, (c, t) in accuracy.items()}
    results["examples"] = [{"seed": e.seed, "question": e.question, "answer": e.answer, "output": o.text}
                           for e, o in zip(examples[:12], outputs[:12], strict=True)]

    subset = examples[: args.swap_items]
    first_changed = full_changed = 0
    own_loss, swapped_loss = [], []
    for example, other, original in tqdm(list(zip(subset, evaluate.swapped(subset), outputs, strict=False)),
                                         desc="swapped images"):
        result = recap.generate(target, example.question, image=other.image(), max_new_tokens=args.max_new_tokens)
        first = evaluate.first_content_token(original.tokens, target.tokenizer)
        first_changed += first != evaluate.first_content_token(result.tokens, target.tokenizer)
        full_changed += result.tokens != original.tokens
        own_loss.append(evaluate.answer_loss(target, example, example.image()))
        swapped_loss.append(evaluate.answer_loss(target, example, other.image()))
    results["image_dependence"] = {
        "items": len(subset), "first_content_token_changed": first_changed / len(subset),
        "full_output_changed": full_changed / len(subset), "loss_own_image": statistics.mean(own_loss),
        "loss_swapped_image": statistics.mean(swapped_loss)}

    alias = examples[: args.alias_items]
    rows = []
    for example, original in tqdm(list(zip(alias, outputs, strict=False)), desc="aliasing rows"):
        inputs = target.prepare(example.question, example.image())
        rows.append(aliasing.request_rows(target, inputs, original.tokens))
    results["aliasing"] = aliasing.measure(rows).as_dict()
    taus = {}
    for name, ablation in (("recap", None), ("persistent-CG", "persistent-CG")):
        proposer = recap.make_proposer("recap", **({"ablation": ablation} if ablation else {}))
        runs = [recap.generate(target, e.question, image=e.image(), method=proposer,
                               max_new_tokens=args.max_new_tokens) for e in tqdm(alias, desc=f"tau {name}")]
        taus[name] = {"tau": statistics.mean(r.tau for r in runs),
                      "identical_to_ar": sum(r.tokens == o.tokens for r, o in zip(runs, outputs, strict=False))}
    results["stream_tau"] = taus
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "examples"}, indent=2))


if __name__ == "__main__":
    main()
