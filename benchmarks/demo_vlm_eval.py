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
import functools
import json
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

import recap
from recap.demo_vlm import aliasing, evaluate
from recap.demo_vlm.scenes import states_attribute

PARTS = ("accuracy", "swap", "aliasing")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--swap-items", type=int, default=100)
    parser.add_argument("--alias-items", type=int, default=60)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"some of {','.join(PARTS)} (to run in parallel)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = recap.load("recap-demo-vlm")
    results: dict = {"threads": args.threads, "max_new_tokens": args.max_new_tokens}
    parts = args.parts.split(",")
    if "accuracy" in parts:
        results["accuracy"] = accuracy(target, evaluate.held_out(args.items), args.max_new_tokens, results)
    if "swap" in parts:
        results["image_dependence"] = image_dependence(target, evaluate.held_out(args.swap_items),
                                                       args.max_new_tokens)
    if "aliasing" in parts:
        results.update(condition_aliasing(target, evaluate.held_out(args.alias_items), args.max_new_tokens))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "examples"}, indent=2))


def ar_outputs(target, examples, max_new_tokens: int, desc: str) -> list:
    return [recap.generate(target, e.question, image=e.image(), max_new_tokens=max_new_tokens)
            for e in tqdm(examples, desc=desc)]


def accuracy(target, examples, max_new_tokens: int, results: dict) -> dict:
    outputs = ar_outputs(target, examples, max_new_tokens, "held-out answers")
    table = evaluate.accuracy(evaluate.score(e, o.text) for e, o in zip(examples, outputs, strict=True))
    results["items"] = len(examples)
    results["examples"] = [{"seed": e.seed, "question": e.question, "answer": e.answer, "output": o.text}
                           for e, o in zip(examples[:16], outputs[:16], strict=True)]
    return {k: {"correct": c, "total": t, "rate": c / t} for k, (c, t) in table.items()}


def image_dependence(target, examples, max_new_tokens: int) -> dict:
    originals = ar_outputs(target, examples, max_new_tokens, "own images")
    first_changed = full_changed = 0
    own_loss, swapped_loss = [], []
    pairs = list(zip(examples, evaluate.swapped(examples), originals, strict=True))
    for example, other, original in tqdm(pairs, desc="swapped images"):
        result = recap.generate(target, example.question, image=other.image(), max_new_tokens=max_new_tokens)
        first = evaluate.first_content_token(original.tokens, target.tokenizer)
        first_changed += first != evaluate.first_content_token(result.tokens, target.tokenizer)
        full_changed += result.tokens != original.tokens
        own_loss.append(evaluate.answer_loss(target, example, example.image()))
        swapped_loss.append(evaluate.answer_loss(target, example, other.image()))
    return {"items": len(examples), "first_content_token_changed": first_changed / len(examples),
            "full_output_changed": full_changed / len(examples), "loss_own_image": statistics.mean(own_loss),
            "loss_swapped_image": statistics.mean(swapped_loss)}


def condition_aliasing(target, examples, max_new_tokens: int) -> dict:
    originals = ar_outputs(target, examples, max_new_tokens, "aliasing: AR")
    rows = [aliasing.request_rows(target, target.prepare(e.question, e.image()), o.tokens)
            for e, o in tqdm(list(zip(examples, originals, strict=True)), desc="aliasing: rows")]
    taus = {}
    for name, options in (("recap (request-local C/G)", {}), ("persistent-CG", {"ablation": "persistent-CG"})):
        proposer = recap.make_proposer("recap", **options)  # one stream over all items
        runs = [recap.generate(target, e.question, image=e.image(), method=proposer, max_new_tokens=max_new_tokens)
                for e in tqdm(examples, desc=f"tau {name}")]
        taus[name] = {"tau": statistics.mean(r.tau for r in runs),
                      "identical_to_ar": sum(r.tokens == o.tokens for r, o in zip(runs, originals, strict=True)),
                      "items": len(examples)}
    tokenizer = target.tokenizer
    content = functools.cache(lambda token: states_attribute(tokenizer.decode([token])))
    return {"aliasing": aliasing.measure(rows, content).as_dict(), "stream_tau": taus}


if __name__ == "__main__":
    main()
