"""Training the demo VLM's vision side on this CPU, in two stages (DESIGN.md section 9).

1. No language model involved, so images are cheap here (hundreds per second). The vision
   tower learns to classify each scene (per grid cell: empty or colour x shape; background;
   kind; bar colours and heights; line colour and point heights) through a throw-away linear
   head, and tower plus projector learn to *write the scene in words*: the 16 projected image
   tokens regress onto SmolLM2's own input embeddings of a 16-token description such as
   " white background red circle top left blue square bottom right . . ." (`scene_words`).
   The frozen LM then starts stage 2 reading something close to text it already understands,
   instead of having to discover a code for colours, shapes, positions and heights.
2. Tower (lower learning rate) and projector learn through the frozen SmolLM2 to answer the
   templated questions, with the loss on the answer tokens only (bfloat16 autocast; the
   vocabulary projection is computed at answer positions only, the rest never needs it).

Both stages draw examples from `scenes.make_example` with seeds below `HELD_OUT_START` and
run a fixed number of steps, so a run is reproducible from its seed (on one thread count).
Checkpoints of the trainable weights are written as the run goes, so an interruption loses at
most one interval.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from recap.demo_vlm.model import IMAGE_TOKENS, build, save_trainable, trainable_parameters
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


PAD_WORD = "."


def scene_words(scene: Scene) -> list[str]:
    """The scene as exactly `IMAGE_TOKENS` single-token words, the stage-1 target of the
    projected image tokens: background and objects in reading order for shapes (a fourth
    object's "bottom right" is cut, it is the only cell left), bar colours with their values,
    or the line colour with its values; padded with `PAD_WORD`."""
    if scene.kind == "shapes":
        words = [f" {scene.background}", " background"]
        for obj in scene.objects:
            vertical, horizontal = obj.position.split()
            words += [f" {obj.colour}", f" {obj.shape}", f" {vertical}", f" {horizontal}"]
    elif scene.kind == "bar chart":
        words = [" bar", " chart"] + [w for colour, value in scene.bars for w in (f" {colour}", str(value))]
    else:
        words = [f" {scene.line_colour}", " line", " chart"] + [str(v) for v in scene.points]
    return (words + [PAD_WORD] * IMAGE_TOKENS)[:IMAGE_TOKENS]


SCENE_WORDS = (
    *(f" {w}" for w in (*BACKGROUNDS, *COLOURS, *SHAPES, "background", "top", "bottom", "left", "right", "bar",
                         "line", "chart")),
    *(str(v) for v in range(CHART_MAX + 1)), PAD_WORD,
)
"""Every word `scene_words` can use."""


class SceneWords:
    """Token ids of `scene_words` and the frozen LM embeddings they regress onto."""

    def __init__(self, tokenizer, embedding: torch.Tensor):
        ids = [tokenizer(word, add_special_tokens=False)["input_ids"] for word in SCENE_WORDS]
        if any(len(i) != 1 for i in ids):
            raise ValueError(f"scene words must be single tokens: {dict(zip(SCENE_WORDS, ids, strict=True))}")
        self.vocabulary = torch.tensor([i[0] for i in ids])
        self.embedding = embedding.detach()[self.vocabulary]

    def targets(self, scenes: list[Scene]) -> torch.Tensor:
        """(scenes, `IMAGE_TOKENS`) indices into `vocabulary`."""
        return torch.tensor([[SCENE_WORDS.index(w) for w in scene_words(s)] for s in scenes])

    def loss(self, image_tokens: torch.Tensor, scenes: list[Scene]) -> torch.Tensor:
        """Squared distance to the target embeddings relative to their squared norm (1.0 is as
        far as predicting zeros), plus cross-entropy of picking the right word by distance
        among all scene words (distance alone leaves near-misses between similar words)."""
        targets = self.targets(scenes)
        wanted = self.embedding[targets]
        regression = ((image_tokens - wanted) ** 2).sum(-1).mean() / (wanted**2).sum(-1).mean()
        logits = -torch.cdist(image_tokens, self.embedding[None]) ** 2
        return regression + nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def nearest_word_accuracy(self, image_tokens: torch.Tensor, scenes: list[Scene]) -> float:
        """How often the nearest scene-word embedding is the right word."""
        nearest = torch.cdist(image_tokens, self.embedding[None]).argmin(-1)
        return float((nearest == self.targets(scenes)).float().mean())


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
    stage1_steps: int = 3000
    """Batches of `stage1_batch` scenes (about 7 minutes on two cores)."""
    stage2_steps: int = 1800
    """Batches of `batch` questions through SmolLM2 (about 1.4 s each on two cores)."""
    projector_only_steps: int = 0
    """First stage-2 steps with the tower frozen. 250 helped a randomly initialised projector
    (its large early gradients washed out the tower); with the scene-words projector a
    200-step trial scored lower with it (and projector lr 2e-3) than without (and 5e-4)."""
    stage1_batch: int = 64
    batch: int = 8
    tower_lr: float = 5e-5
    projector_lr: float = 5e-4
    final_lr_fraction: float = 0.1
    """Stage-2 learning rates follow a cosine from 1 down to this fraction."""
    content_weight: float = 1.0
    """Loss weight of answer tokens that state an attribute (1 = plain mean). 4.0 was tried
    (800 steps, tower lr 1e-4, 100 projector-only steps) and scored lower held-out."""
    checkpoint_every: int = 50


def example_stream(seed: int, start: int = 0) -> Iterator[Example]:
    """Training examples in a seeded order over seeds below `HELD_OUT_START`."""
    rng = np.random.default_rng([seed, start])
    while True:
        yield make_example(int(rng.integers(0, HELD_OUT_START)))


def train_stage1(model, words: SceneWords, config: TrainConfig, log) -> None:
    tower, projector = model.model.vision_tower, model.model.multi_modal_projector
    head = SceneHead(tower.config.hidden_size * (tower.config.image_size // tower.config.patch_size) ** 2)
    optimiser = torch.optim.AdamW([*tower.parameters(), *projector.parameters(), *head.parameters()],
                                  lr=1e-3, weight_decay=0.01)
    stream = example_stream(config.seed, 1)
    tower.train()
    step = 0
    with tqdm(desc="stage 1 (vision tower, scene words)", unit="step", total=config.stage1_steps) as bar:
        while step < config.stage1_steps:
            examples = [next(stream) for _ in range(config.stage1_batch)]
            scenes = [e.scene for e in examples]
            labels = {name: torch.tensor([scene_labels(s)[name] for s in scenes]) for name in HEADS}
            features = tower_features(tower, pixels([e.image() for e in examples]))
            head_loss = head.loss(features, labels)
            words_loss = words.loss(projector(features), scenes)
            loss = head_loss + words_loss
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            step += 1
            bar.update()
            bar.set_postfix(head=f"{head_loss.item():.3f}", words=f"{words_loss.item():.3f}")
            if step % 20 == 0:
                log({"stage": 1, "step": step, "loss": head_loss.item(), "words_loss": words_loss.item()})
    tower.eval()
    with torch.no_grad():
        examples = [make_example(HELD_OUT_START + i) for i in range(512)]  # drawn and run once for both
        scenes, features = [e.scene for e in examples], tower_features(tower, pixels([e.image() for e in examples]))
        log({"stage": 1, "held_out_accuracy": head_accuracy(head, features, scenes),
             "held_out_word_accuracy": words.nearest_word_accuracy(projector(features), scenes)})


def tower_features(tower, pixel_values: torch.Tensor) -> torch.Tensor:
    """The features LLaVA hands to the projector (``vision_feature_layer=-1``: the last
    encoder layer's output, before the post-layernorm), so stage 1 shapes exactly those."""
    return tower(pixel_values=pixel_values, output_hidden_states=True).hidden_states[-1]


def head_accuracy(head: SceneHead, features: torch.Tensor, scenes: list[Scene]) -> dict[str, float]:
    """Stage-1 accuracy per head on the tower ``features`` of ``scenes`` (slots that apply only)."""
    n = len(scenes)
    logits = head.linear(features.flatten(1))
    labels = [scene_labels(scene) for scene in scenes]
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
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, functools.partial(
        cosine, steps=config.stage2_steps, floor=config.final_lr_fraction))
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
                loss = answer_loss(model, batch, labels, weights)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            schedule.step()
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


def cosine(step: int, steps: int, floor: float) -> float:
    """Learning-rate factor: a half cosine from 1 at step 0 to ``floor`` at ``steps``."""
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))


def answer_loss(model, batch: dict[str, torch.Tensor], labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the answer tokens, weighted per token. The vocabulary
    projection (a fifth of SmolLM2's weights) runs on the answer positions only."""
    hidden = model.model(**batch).last_hidden_state[:, :-1]
    targets, weights = labels[:, 1:], weights[:, 1:]
    scored = targets != IGNORE
    logits = model.lm_head(hidden[scored]).float()
    losses = nn.functional.cross_entropy(logits, targets[scored], reduction="none")
    return (losses * weights[scored]).sum() / weights[scored].sum()


def _metadata(config: TrainConfig, steps: int) -> dict[str, str]:
    return {"format": "recap-demo-vlm", "version": "1", "seed": str(config.seed), "stage2_steps": str(steps),
            "config": json.dumps(config.__dict__)}


def train(smollm2_folder: Path, out: Path, config: TrainConfig) -> None:
    """Both stages; the trainable weights end up in ``out`` (a .safetensors file), the loss
    curve beside it (``out`` with suffix .log.jsonl)."""
    torch.manual_seed(config.seed)
    model, processor = build(smollm2_folder, seed=config.seed)
    trainable_parameters(model)
    words = SceneWords(processor.tokenizer, model.get_input_embeddings().weight)
    log_path = out.with_suffix(".log.jsonl")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as handle:
        def log(row: dict) -> None:
            handle.write(json.dumps({**row, "time": round(time.monotonic() - started, 1)}) + "\n")
            handle.flush()

        started = time.monotonic()
        train_stage1(model, words, config, log)
        train_stage2(model, processor, config, out, log)
