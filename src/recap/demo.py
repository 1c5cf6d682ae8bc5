"""``make demo`` / ``recap demo``: AR against drafting methods, outputs checked identical.

On the project's own demo VLM (the default) the inputs are a few held-out synthetic scenes,
saved as PNG files next to the output so a person can look at what the model described; on a
text model, a few built-in prompts. Each input runs once per method for warm-up, then the
methods alternate ``REPEATS`` times. Every timed run uses a fresh proposer (no memory carried
over from the warm-up, which saw the same input), so the numbers are cold-start numbers. The
table shows median tokens/s per method, the speedup against AR (ratio of medians from the
same run) and tau, and checks every output against AR token for token.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
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
DEMO_SCENES = (3, 0, 6, 1)
"""Held-out scene numbers (offsets from `HELD_OUT_START`) shown by the demo VLM."""
REPEATS = 2
CPU_BUDGET = 16
"""RECAP's tree size in the demo: on a CPU a 64-node verify costs ~4.8x one token (README),
so the demo uses a CPU-sized tree; ``--budget 63`` gives the paper's GPU setting."""


@dataclass(frozen=True)
class DemoInput:
    question: str
    image: Image.Image | None
    name: str
    """Table label: the prompt's start, or the saved image's file name."""
    note: str = ""
    """Shown above the output: where the image is and what it really shows."""


def demo_inputs(target, out: Path) -> list[DemoInput]:
    """The built-in prompts, or for a VLM held-out scenes (saved as PNG into ``out``)."""
    if not target.accepts_images:
        return [DemoInput(p, None, p[:28] + ("..." if len(p) > 28 else "")) for p in DEMO_PROMPTS]
    from recap.demo_vlm.scenes import HELD_OUT_START, caption, make_example

    out.mkdir(parents=True, exist_ok=True)
    inputs = []
    for offset in DEMO_SCENES:
        example = make_example(HELD_OUT_START + offset)
        path = out / f"scene-{offset}.png"
        image = example.image()
        image.resize((256, 256), Image.NEAREST).save(path)  # 64 px, enlarged to look at
        truth = caption(example.scene, np.random.default_rng(0))
        inputs.append(DemoInput("Describe the image.", image, path.name, f"{path}; truth: {truth}"))
    return inputs


def run_demo(model: str = "recap-demo-vlm", methods: tuple[str, ...] = ("pld", "recap"), *, dtype: str = "float32",
             max_new_tokens: int = 64, budget: int | None = CPU_BUDGET, out: str | Path = "demo-out") -> int:
    console = Console(width=max(Console().width, 110))
    target = load(model, dtype=dtype)
    names = ["ar", *methods]
    budget_note = f" (recap budget {budget})" if "recap" in methods and budget is not None else ""
    console.print(f"[bold]RECAP demo[/]: {model}, {dtype}, {torch.get_num_threads()} thread(s), AR vs "
                  f"{', '.join(methods)}{budget_note}, {max_new_tokens} new tokens at most")

    def proposer(name: str):
        return make_proposer(name, budget=budget) if name == "recap" and budget is not None else make_proposer(name)

    table = Table("input", *(f"{n} tok/s" for n in names), *(f"{n} speedup (tau)" for n in methods), "identical")
    speedups: dict[str, list[float]] = {name: [] for name in methods}
    all_identical = True
    for item in demo_inputs(target, Path(out)):
        inputs = target.prepare(item.question, item.image)
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
        table.add_row(item.name, *(f"{speed[n]:.1f}" for n in names), *cells, "yes" if identical else "[red]NO[/]")
        text = target.tokenizer.decode(runs["ar"][0].tokens, skip_special_tokens=True).strip()
        console.print(f"[dim]> {item.question}  {item.note}[/]\n{text}\n")
    console.print(table)
    summary = ", ".join(f"{name} {statistics.mean(values):.2f}x" for name, values in speedups.items())
    console.print(f"mean speedup vs AR: {summary}; outputs identical to AR: {'yes' if all_identical else 'NO'}")
    return 0 if all_identical else 1
