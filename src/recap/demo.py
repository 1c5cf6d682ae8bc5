"""``make demo`` / ``recap demo``: AR against drafting methods on a few built-in prompts.

Each prompt runs once per method for warm-up, then the methods alternate ``REPEATS`` times.
Every timed run uses a fresh proposer (no memory carried over from the warm-up, which saw the
same prompt), so RECAP's numbers here are its cold-start numbers. The table shows median
tokens/s per method, the speedup against AR (ratio of medians from the same run) and tau,
and checks every output against AR token for token.
"""

from __future__ import annotations

import statistics

import torch
from rich.console import Console
from rich.table import Table

from recap.decoding import GenerationResult, decode
from recap.models import load
from recap.proposers import make_proposer

DEMO_PROMPTS = [
    "Correct the spelling in this sentence and repeat it: 'The quik brown fox jumpd over the lazy dogg.'",
    "Put these words in alphabetical order, one per line: pear, apple, mango, banana, cherry, grape.",
    "What is the capital of France? Answer in one sentence.",
]
REPEATS = 2


def run_demo(model: str = "smollm2-135m", methods: tuple[str, ...] = ("pld", "recap"), *, dtype: str = "float32",
             max_new_tokens: int = 64, budget: int | None = None) -> int:
    console = Console(width=max(Console().width, 110))
    console.print(f"[bold]RECAP demo[/]: {model}, {dtype}, {torch.get_num_threads()} thread(s), AR vs "
                  f"{', '.join(methods)}, {max_new_tokens} new tokens at most")
    target = load(model, dtype=dtype)
    names = ["ar", *methods]

    def proposer(name: str):
        return make_proposer(name, budget=budget) if name == "recap" and budget is not None else make_proposer(name)

    table = Table("prompt", *(f"{n} tok/s" for n in names), *(f"{n} speedup (tau)" for n in methods), "identical")
    speedups: dict[str, list[float]] = {name: [] for name in methods}
    all_identical = True
    for prompt in DEMO_PROMPTS:
        inputs = target.prepare(prompt)
        runs: dict[str, list[GenerationResult]] = {name: [] for name in names}
        for name in names:  # warm-up
            decode(target, proposer(name), inputs, max_new_tokens=max_new_tokens)
        for _ in range(REPEATS):
            for name in names:
                runs[name].append(decode(target, proposer(name), inputs, max_new_tokens=max_new_tokens))
        speed = {name: statistics.median(r.tokens_per_s for r in runs[name]) for name in names}
        identical = all(r.tokens == runs["ar"][0].tokens for rs in runs.values() for r in rs)
        all_identical &= identical
        cells = []
        for name in methods:
            speedups[name].append(speed[name] / speed["ar"])
            cells.append(f"{speedups[name][-1]:.2f}x ({runs[name][0].tau:.2f})")
        table.add_row(prompt[:28] + ("..." if len(prompt) > 28 else ""), *(f"{speed[n]:.1f}" for n in names),
                      *cells, "yes" if identical else "[red]NO[/]")
        text = target.tokenizer.decode(runs["ar"][0].tokens, skip_special_tokens=True).strip()
        console.print(f"[dim]> {prompt}[/]\n{text}\n")
    console.print(table)
    summary = ", ".join(f"{name} {statistics.mean(values):.2f}x" for name, values in speedups.items())
    console.print(f"mean speedup vs AR: {summary}; outputs identical to AR: {'yes' if all_identical else 'NO'}")
    return 0 if all_identical else 1
