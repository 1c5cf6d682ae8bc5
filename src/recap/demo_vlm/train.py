"""Training the demo VLM's vision side on this CPU, in two stages (DESIGN.md section 9).

1. The vision tower alone learns to classify each scene (per grid cell: empty or colour x
   shape; background; kind; bar colours and heights; line colour and point heights) through
   a throw-away linear head. Images are cheap here (hundreds per second), so the tower learns
   to see shapes and heights before any text is involved.
2. Tower (lower learning rate) and projector learn through the frozen SmolLM2 to answer the
   templated questions, with the loss on the answer tokens only (bfloat16 autocast).

Both stages draw examples from `scenes.make_example` with seeds below `HELD_OUT_START` and
run a fixed number of steps, so a run is reproducible from its seed (on one thread count).
Checkpoints of the trainable weights are written as the run goes, so an interruption loses at
most one interval.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from recap.demo_vlm.model import build, save_trainable, trainable_parameters
from recap.demo_vlm.scenes import (
    BACKGROUNDS,
    CHART_MAX,
    COLOURS,
    HELD_OUT_START,
    POSITIONS,
    SHAPES,
    Example,
    Scene,
    make_example,
    states_attribute,
)

KINDS = ("shapes", "bar chart", "line chart")
MAX_BARS, MAX_POINTS = 4, 5
HEADS: dict[str, tuple[int, int]] = {
    # name: (slots, classes per slot); class 0 is "none" where a slot can be empty
    "kind": (1, len(KINDS)),
    "background": (1, len(BACKGROUNDS)),
    "cell": (len(POSITIONS), 1 + len(COLOURS) * len(SHAPES)),
    "bar colour": (MAX_BARS, 1 + len(COLOURS)),
    "bar value": (MAX_BARS, 1 + CHART_MAX),
    "line colour": (1, len(COLOURS)),
    "point value": (MAX_POINTS, 1 + CHART_MAX),
}
IGNORE = -100


def pixels(images: list) -> torch.Tensor:
    """(B, 3, H, W) float pixels normalised like SigLIP's processor ((x / 255 - 0.5) / 0.5)."""
    array = np.stack([np.asarray(image, dtype=np.float32) for image in images]) / 127.5 - 1.0
    return torch.from_numpy(array).permute(0, 3, 1, 2).contiguous()


def scene_labels(scene: Scene) -> dict[str, list[int]]:
    """Stage-1 targets of one scene; slots that do not apply are ``IGNORE``."""
    colours, shapes = list(COLOURS), list(SHAPES)
    labels = {name: [IGNORE] * slots for name, (slots, _) in HEADS.items()}
    labels["kind"] = [KINDS.index(scene.kind)]
    if scene.kind == "shapes":
        labels["background"] = [list(BACKGROUNDS).index(scene.background)]
        cells = [0] * len(POSITIONS)
        for obj in scene.objects:
            cells[POSITIONS.index(obj.position)] = 1 + colours.index(obj.colour) * len(shapes) + shapes.index(obj.shape)
        labels["cell"] = cells
    elif scene.kind == "bar chart":
        labels["bar colour"] = [1 + colours.index(c) for c, _ in scene.bars] + [0] * (MAX_BARS - len(scene.bars))
        labels["bar value"] = [v for _, v in scene.bars] + [0] * (MAX_BARS - len(scene.bars))
    else:
        labels["line colour"] = [colours.index(scene.line_colour)]
        labels["point value"] = list(scene.points) + [0] * (MAX_POINTS - len(scene.points))
    return labels


class SceneHead(nn.Module):
    """Linear read-out of all patch features: position matters, so no pooling."""

    def __init__(self, features: int):
        super().__init__()
        self.linear = nn.Linear(features, sum(slots * classes for slots, classes in HEADS.values()))

    def loss(self, patch_features: torch.Tensor, labels: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.linear(patch_features.flatten(1))
        total, start = logits.new_zeros(()), 0
        for name, (slots, classes) in HEADS.items():
            part = logits[:, start : start + slots * classes].reshape(-1, classes)
            start += slots * classes
            target = labels[name].reshape(-1)
            if (target != IGNORE).any():
                total = total + nn.functional.cross_entropy(part, target, ignore_index=IGNORE)
        return total


@dataclass
class TrainConfig:
    seed: int = 0
    stage1_steps: int = 1500
    """Batches of `stage1_batch` scenes (about 8 minutes on one core)."""
    stage2_steps: int = 1000
    """Batches of `batch` questions through SmolLM2 (about 2 s each on one core)."""
    projector_only_steps: int = 250
    """First stage-2 steps with the tower frozen, so the fresh projector's large early
    gradients do not wash out what stage 1 taught the tower."""
    stage1_batch: int = 64
    batch: int = 8
    tower_lr: float = 5e-5
    content_weight: float = 1.0
    """Loss weight of answer tokens that state an attribute (1 = plain mean). 4.0 was tried
    (800 steps, tower lr 1e-4, 100 projector-only steps) and scored lower held-out."""
    projector_lr: float = 2e-3
    checkpoint_every: int = 50


def example_stream(seed: int, start: int = 0) -> Iterator[Example]:
    """Training examples in a seeded order over seeds below `HELD_OUT_START`."""
    rng = np.random.default_rng([seed, start])
    while True:
        yield make_example(int(rng.integers(0, HELD_OUT_START)))


def train_stage1(model, config: TrainConfig, log) -> None:
    tower = model.model.vision_tower
    head = SceneHead(tower.config.hidden_size * (tower.config.image_size // tower.config.patch_size) ** 2)
    optimiser = torch.optim.AdamW([*tower.parameters(), *head.parameters()], lr=1e-3, weight_decay=0.01)
    stream = example_stream(config.seed, 1)
    tower.train()
    step = 0
    with tqdm(desc="stage 1 (vision tower)", unit="step", total=config.stage1_steps) as bar:
        while step < config.stage1_steps:
            examples = [next(stream) for _ in range(config.stage1_batch)]
            labels = {name: torch.tensor([scene_labels(e.scene)[name] for e in examples]) for name in HEADS}
            loss = head.loss(tower_features(tower, pixels([e.image() for e in examples])), labels)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            step += 1
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if step % 20 == 0:
                log({"stage": 1, "step": step, "loss": loss.item()})
    tower.eval()
    log({"stage": 1, "held_out_accuracy": head_accuracy(tower, head)})


def tower_features(tower, pixel_values: torch.Tensor) -> torch.Tensor:
    """The features LLaVA hands to the projector (``vision_feature_layer=-1``: the last
    encoder layer's output, before the post-layernorm), so stage 1 shapes exactly those."""
    return tower(pixel_values=pixel_values, output_hidden_states=True).hidden_states[-1]


@torch.no_grad()
def head_accuracy(tower, head: SceneHead, n: int = 512) -> dict[str, float]:
    """Stage-1 accuracy per head on held-out scenes (slots that apply only)."""
    examples = [make_example(HELD_OUT_START + i) for i in range(n)]
    logits = head.linear(tower_features(tower, pixels([e.image() for e in examples])).flatten(1))
    labels = [scene_labels(e.scene) for e in examples]
    result, start = {}, 0
    for name, (slots, classes) in HEADS.items():
        part = logits[:, start : start + slots * classes].reshape(n, slots, classes).argmax(-1)
        start += slots * classes
        target = torch.tensor([row[name] for row in labels])
        mask = target != IGNORE
        result[name] = float((part[mask] == target[mask]).float().mean()) if mask.any() else float("nan")
    return result


def answer_batch(processor, examples: list[Example], content_weight: float = 1.0) -> dict[str, torch.Tensor]:
    """Inputs, labels and per-token loss weights for a batch: loss on the answer and its
    end-of-turn token only, tokens that state an image attribute weighted ``content_weight``
    (the template words are learnt from text alone and would otherwise dominate the loss)."""
    tokenizer = processor.tokenizer
    rows, labels, weights = [], [], []
    for example in examples:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": example.question}]}]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = processor(text=[prompt], images=[example.image()], return_tensors="pt")["input_ids"][0].tolist()
        answer_ids = tokenizer(example.answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
        rows.append(prompt_ids + answer_ids)
        labels.append([IGNORE] * len(prompt_ids) + answer_ids)
        weights.append([0.0] * len(prompt_ids) + [content_weight if states_attribute(tokenizer.decode([t])) else 1.0
                                                   for t in answer_ids])
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return {
        "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        "labels": torch.tensor([r + [IGNORE] * (width - len(r)) for r in labels]),
        "weights": torch.tensor([r + [0.0] * (width - len(r)) for r in weights]),
        "pixel_values": pixels([e.image() for e in examples]),
    }


def train_stage2(model, processor, config: TrainConfig, out: Path, log) -> None:
    trainable_parameters(model)
    tower_params = list(model.model.vision_tower.parameters())
    optimiser = torch.optim.AdamW([
        {"params": tower_params, "lr": config.tower_lr},
        {"params": list(model.model.multi_modal_projector.parameters()), "lr": config.projector_lr},
    ], weight_decay=0.0)
    stream = example_stream(config.seed, 2)
    model.train()
    step, recent = 0, []
    with tqdm(desc="stage 2 (through SmolLM2)", unit="step", total=config.stage2_steps) as bar:
        while step < config.stage2_steps:
            for param in tower_params:
                param.requires_grad = step >= config.projector_only_steps
            batch = answer_batch(processor, [next(stream) for _ in range(config.batch)], config.content_weight)
            labels, weights = batch.pop("labels"), batch.pop("weights")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(**batch).logits
            loss = weighted_loss(logits, labels, weights)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            step += 1
            recent = (recent + [loss.item()])[-50:]
            bar.update()
            bar.set_postfix(loss=f"{np.mean(recent):.3f}")
            if step % 10 == 0:
                log({"stage": 2, "step": step, "loss": float(np.mean(recent[-10:]))})
            if step % config.checkpoint_every == 0:
                save_trainable(model, out, _metadata(config, step))
    model.eval()
    save_trainable(model, out, _metadata(config, step))


def weighted_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, weighted per target token (prompt and padding weigh 0)."""
    losses = nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels[:, 1:],
                                         ignore_index=IGNORE, reduction="none")
    weights = weights[:, 1:]
    return (losses * weights).sum() / weights.sum()


def _metadata(config: TrainConfig, steps: int) -> dict[str, str]:
    return {"format": "recap-demo-vlm", "version": "1", "seed": str(config.seed), "stage2_steps": str(steps),
            "config": json.dumps(config.__dict__)}


def train(smollm2_folder: Path, out: Path, config: TrainConfig) -> None:
    """Both stages; the trainable weights end up in ``out`` (a .safetensors file), the loss
    curve beside it (``out`` with suffix .log.jsonl)."""
    torch.manual_seed(config.seed)
    model, processor = build(smollm2_folder, seed=config.seed)
    for param in model.parameters():
        param.requires_grad = False
    for param in model.model.vision_tower.parameters():
        param.requires_grad = True
    log_path = out.with_suffix(".log.jsonl")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as handle:
        def log(row: dict) -> None:
            handle.write(json.dumps({**row, "time": round(time.monotonic() - started, 1)}) + "\n")
            handle.flush()

        started = time.monotonic()
        train_stage1(model, config, log)
        train_stage2(model, processor, config, out, log)
