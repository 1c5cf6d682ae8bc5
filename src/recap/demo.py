"""``make demo`` / ``recap demo``: AR vs a drafter on a few built-in prompts.

Each prompt runs once for warm-up, then AR and the method alternate twice; the table
shows the median tokens/s of each, the speedup (ratio of medians from the same run) and
whether the outputs are identical.
"""

from __future__ import annotations

import statistics

import torch
from rich.console import Console
from rich.table import Table

from recap.decoding import decode
from recap.models import load
from recap.proposers import make_proposer

DEMO_PROMPTS = [
    "Correct the spelling in this sentence and repeat it: 'The quik brown fox jumpd over the lazy dogg.'",
    "Put these words in alphabetical order, one per line: pear, apple, mango, banana, cherry, grape.",
    "What is the capital of France? Answer in one sentence.",
]
REPEATS = 2


def run_demo(model: str = "smollm2-135m", method: str = "pld", *, dtype: str = "float32", max_new_tokens: int = 64,
             threads: int | None = 1) -> int:
    console = Console()
    console.print(f"[bold]RECAP demo[/]: {model}, {dtype}, {torch.get_num_threads()} thread(s), "
                  f"AR vs {method}, {max_new_tokens} new tokens at most")
    target = load(model, dtype=dtype)
    table = Table("prompt", "AR tok/s", f"{method} tok/s", "speedup", "tau", "identical")
    all_identical = True
    ratios = []
    for prompt in DEMO_PROMPTS:
        inputs = target.prepare(prompt)
        runs: dict[str, list] = {"ar": [], method: []}
        decode(target, make_proposer("ar"), inputs, max_new_tokens=max_new_tokens)  # warm-up
        for _ in range(REPEATS):
            for name in runs:
                runs[name].append(decode(target, make_proposer(name), inputs, max_new_tokens=max_new_tokens))
        ar_speed = statistics.median(r.tokens_per_s for r in runs["ar"])
        method_speed = statistics.median(r.tokens_per_s for r in runs[method])
        identical = all(r.tokens == runs["ar"][0].tokens for rs in runs.values() for r in rs)
        all_identical &= identical
        ratios.append(method_speed / ar_speed)
        table.add_row(prompt[:48] + ("..." if len(prompt) > 48 else ""), f"{ar_speed:.1f}", f"{method_speed:.1f}",
                      f"{ratios[-1]:.2f}x", f"{runs[method][0].tau:.2f}", "yes" if identical else "[red]NO[/]")
        text = target.tokenizer.decode(runs[method][0].tokens, skip_special_tokens=True).strip()
        console.print(f"[dim]> {prompt}[/]\n{text}\n")
    console.print(table)
    console.print(f"mean speedup {statistics.mean(ratios):.2f}x; outputs identical to AR: "
                  f"{'yes' if all_identical else 'NO'}")
    return 0 if all_identical else 1
