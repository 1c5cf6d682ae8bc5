"""A RECAP memory for the demo VLM, as a server that has answered earlier requests would hold.

RECAP's memory is meant to persist: a long-running stream keeps the target's Top-K rows, its
earlier outputs and its acceptance statistics. `build_memory` runs RECAP over ``requests``
training-range scenes (seeds from `FIRST_SEED`, never the held-out ones the demo shows) with
the demo's question and saves that stream's state. ``make demo`` loads it into a fresh stream
for its ``recap+memory`` column; the file changes only speed (verification keeps every
output exact), and ``recap demo-vlm-memory`` rebuilds it.
"""

from __future__ import annotations

from pathlib import Path

from rich.progress import Progress

from recap.decoding import decode
from recap.demo_vlm.scenes import HELD_OUT_START, make_example

MEMORY = Path(__file__).parent / "weights" / "recap-demo-vlm.memory.safetensors"
"""The shipped memory (``recap demo-vlm-memory`` with its defaults)."""
FIRST_SEED = 1000
"""Scenes from this seed up: training-range seeds, far below `HELD_OUT_START`."""
QUESTION = "Describe the image."
"""The demo's question (`recap.demo`), so the earlier requests are requests like its own."""
REQUESTS = 300


def build_memory(target, out: Path = MEMORY, *, requests: int = REQUESTS, max_new_tokens: int = 64) -> Path:
    """Run RECAP over ``requests`` earlier scenes as one stream and save its memory to ``out``."""
    from recap.proposers import make_proposer

    if FIRST_SEED + requests > HELD_OUT_START:
        raise ValueError(f"at most {HELD_OUT_START - FIRST_SEED} requests stay below the held-out seeds")
    proposer = make_proposer("recap")
    with Progress(transient=True) as progress:
        task = progress.add_task("earlier requests", total=requests)
        for seed in range(FIRST_SEED, FIRST_SEED + requests):
            inputs = target.prepare(QUESTION, make_example(seed).image())
            decode(target, proposer, inputs, max_new_tokens=max_new_tokens)
            progress.advance(task)
    out.parent.mkdir(parents=True, exist_ok=True)
    proposer.save_memory(out)
    return out
