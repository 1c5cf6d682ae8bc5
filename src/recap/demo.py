"""``make demo`` / ``recap demo``: AR against drafting methods, outputs checked identical.

On the project's own demo VLM (the default) the inputs are a few held-out synthetic scenes,
saved as PNG files next to the output so a person can look at what the model described; on a
text model, a few built-in prompts. The inputs run as one *stream* per method, as a server
would see them: each method's proposer is made once per pass and carries what it learned from
one input to the next (every method alike; no input is seen twice in a pass). One untimed
warm-up pass, then ``REPEATS`` timed passes, each with fresh streams; within an input the
methods alternate. On the demo VLM one more column, ``recap+memory``, starts RECAP's stream
from the shipped memory of 300 earlier requests on other (training-range) scenes
(`recap.demo_vlm.memory`): what a server that has been answering such requests holds. The
table shows AR's median tokens/s, each method's speedup against AR (ratio of medians from the
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
DEMO_SCENES = (3, 0, 6, 1, 4, 2)
"""Held-out scene numbers (offsets from `HELD_OUT_START`) shown by the demo VLM."""
REPEATS = 2
DEMO_METHODS = ("pld", "sam", "recap")
WITH_MEMORY = "recap+memory"
"""The column of RECAP started from a saved memory (`run_demo`'s ``memory``)."""


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


def run_demo(model: str = "recap-demo-vlm", methods: tuple[str, ...] = DEMO_METHODS, *, dtype: str = "float32",
             max_new_tokens: int = 64, budget: int | None = None, out: str | Path = "demo-out",
             cost_profile: str | None = "auto", memory: str | Path | None = "auto", kernels: str = "auto",
             weights: str = "auto") -> int:
    """``memory``: a RECAP memory file for the ``recap+memory`` column; ``auto`` is the shipped
    one on the demo VLM (no column on other models), None or ``none`` drops the column."""
    console = Console(width=max(Console().width, 110))
    target = load(model, dtype=dtype, kernels=kernels, weights=weights)
    target.use_cost_profile(cost_profile)
    memory = _memory_file(model, memory)
    if memory is not None:
        from recap.core.persistence import read_token_memory

        read_token_memory(memory)  # a bad file is reported now, not after the first pass
        methods = (*methods, WITH_MEMORY)
    names = ["ar", *methods]
    budget_note = f" (recap budget {budget})" if "recap" in methods and budget is not None else ""
    console.print(f"[bold]RECAP demo[/]: {model}, {dtype}, {target.kernels} kernels ({target.weights} weights), "
                  f"{torch.get_num_threads()} thread(s), AR vs {', '.join(methods)}{budget_note}, "
                  f"{max_new_tokens} new tokens at most; the inputs run as "
                  "one stream per method")

    def proposer(name: str):
        if name == WITH_MEMORY:
            return make_proposer("recap", memory_file=memory)
        return make_proposer(name, budget=budget) if name.startswith("recap") and budget is not None \
            else make_proposer(name)

    items = demo_inputs(target, Path(out))
    prepared = [target.prepare(item.question, item.image) for item in items]
    runs: list[dict[str, list[GenerationResult]]] = [{name: [] for name in names} for _ in items]
    for timed_pass in range(REPEATS + 1):  # pass 0 warms up (kernels, numba, profile) and is not recorded
        streams = {name: proposer(name) for name in names}
        for index, inputs in enumerate(prepared):
            for name in names:
                result = decode(target, streams[name], inputs, max_new_tokens=max_new_tokens)
                if timed_pass:
                    runs[index][name].append(result)

    table = Table("input", "ar tok/s", *methods, "identical", caption="speedup vs AR (tau: tokens per step)")
    speedups: dict[str, list[float]] = {name: [] for name in methods}
    all_identical = True
    for item, item_runs in zip(items, runs):
        speed = {name: statistics.median(r.tokens_per_s for r in item_runs[name]) for name in names}
        identical = all(r.tokens == item_runs["ar"][0].tokens for rs in item_runs.values() for r in rs)
        all_identical &= identical
        cells = []
        for name in methods:
            speedups[name].append(speed[name] / speed["ar"])
            cells.append(f"{speedups[name][-1]:.2f}x ({item_runs[name][0].tau:.2f})")
        table.add_row(item.name, f"{speed['ar']:.1f}", *cells, "yes" if identical else "[red]NO[/]")
        text = target.tokenizer.decode(item_runs["ar"][0].tokens, skip_special_tokens=True).strip()
        console.print(f"[dim]> {item.question}  {item.note}[/]\n{text}\n")
    console.print(table)
    if memory is not None:
        console.print(f"[dim]{WITH_MEMORY}: recap starting from {memory}, the memory of earlier requests on other "
                      "scenes (rebuild: recap demo-vlm-memory); every other column starts cold[/]")
    summary = ", ".join(f"{name} {statistics.mean(values):.2f}x" for name, values in speedups.items())
    console.print(f"mean speedup vs AR: {summary}; outputs identical to AR: {'yes' if all_identical else 'NO'}")
    return 0 if all_identical else 1


def _memory_file(model: str, memory: str | Path | None) -> Path | None:
    if memory is None or str(memory) == "none":
        return None
    if str(memory) == "auto":
        from recap.demo_vlm.memory import MEMORY

        return MEMORY if model == "recap-demo-vlm" and MEMORY.exists() else None
    return Path(memory)
