"""Seconds per stage-2 training step of the demo VLM (batch 8 through the frozen SmolLM2):
full logits vs the answer-only vocabulary projection (`train.answer_loss`), bfloat16
autocast vs float32. The measurement behind `TrainConfig`'s choices.

    .venv/bin/python benchmarks/demo_vlm_step_time.py --threads 2 --steps 5
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from recap.demo_vlm.model import build, trainable_parameters
from recap.demo_vlm.train import IGNORE, answer_batch, answer_loss, example_stream
from recap.models import smollm2_folder


def full_logits_loss(model, batch, labels, weights) -> torch.Tensor:
    """The straightforward way: logits at every position, then the weighted answer loss."""
    logits = model(**batch).logits[:, :-1].float()
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=IGNORE,
                                               reduction="none")
    return (losses * weights[:, 1:]).sum() / weights[:, 1:].sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant, after one warm-up step")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, processor = build(smollm2_folder(), seed=0)
    optimiser = torch.optim.AdamW(trainable_parameters(model), lr=1e-4)
    stream = example_stream(0, 2)
    batches = [answer_batch(processor, [next(stream) for _ in range(8)]) for _ in range(args.steps + 1)]
    model.train()
    print(f"threads {torch.get_num_threads()}, batch 8, median of {args.steps} steps after a warm-up")
    for name, loss_fn in (("full logits", full_logits_loss), ("answer-only", answer_loss)):
        for dtype in ("bfloat16", "float32"):
            times = []
            for batch in batches:
                batch = dict(batch)
                labels, weights = batch.pop("labels"), batch.pop("weights")
                autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16"
                            else contextlib.nullcontext())
                started = time.perf_counter()
                with autocast:
                    loss = loss_fn(model, batch, labels, weights)
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                times.append(time.perf_counter() - started)
            print(f"{name:12s} {dtype:9s} {statistics.median(times[1:]):.2f} s/step")


if __name__ == "__main__":
    main()
