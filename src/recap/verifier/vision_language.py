"""Adapters for the vision-language families: Qwen2-VL / Qwen2.5-VL, LLaVA(-NeXT) and Gemma 3.

Each only changes how a prompt and an image become model inputs, which tokens are image
placeholders, (Qwen) the position offset and (Gemma 3) how an image's rows attend to each
other at prefill. Verification itself is shared.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from PIL import Image

from recap.verifier.base import TargetModel
from recap.verifier.image_attention import ImageAttentionCapture
from recap.verifier.inputs import Message, ModelInputs, encode_images


def with_image(messages: list[Message], image: Image.Image | None) -> list[Message]:
    """Chat messages in the processor's content-list form, the image in the first user turn."""
    out: list[Message] = []
    placed = image is None
    for message in messages:
        content = message.get("content", "")
        items = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        if not placed and message.get("role") == "user":
            items = [{"type": "image"}, *items]
            placed = True
        out.append({**message, "content": items})
    return out


class _VisionLanguageTarget(TargetModel):
    """What every vision-language family shares: prompts with an image, the image
    placeholder token, the vision tower run apart (`encode_images`) and the capture of the
    attention on the image (SAM+ViSkip)."""

    accepts_images = True
    causal_images = True
    """Whether an image's rows attend causally at prefill, as text rows do: the fast kernels
    then prefill them in chunks, as one-token steps would; False (Gemma 3, whose image rows
    see each other both ways): transformers' forward prefills an image prompt and its K/V
    move into the kernels' cache (the decode steps after it run on the kernels)."""

    def __init__(self, model: torch.nn.Module, processor: Any, **options: Any):
        super().__init__(model, processor, **options)
        self.image_token = getattr(model.config, "image_token_id", None)
        self.encode_lock = threading.Lock()
        """One image encode at a time on this model (`recap.verifier.inputs.encode_images`)."""

    def capture_image_attention(self, enabled: bool = True) -> bool:
        """Turn on (or off) the measurement of the attention mass on the prompt's image tokens
        (`recap.verifier.image_attention`), reported by prefill and verify as ``image_attention``.
        Returns whether it is on (a text-only model or an unsupported attention cannot)."""
        if not enabled or self.image_token is None:
            if self.capture is not None:
                self.capture.disable()
            return False
        if self.capture is None:
            self.capture = ImageAttentionCapture.for_model(self.model)
        return self.capture is not None and self.capture.enable()

    def encode_images(self, inputs: ModelInputs) -> ModelInputs:
        """Run the vision tower of an image prompt now (`recap.verifier.inputs.encode_images`),
        so the decoding thread only prefills the language rows, in chunks beside the running
        requests. Text prompts, the stock kernels and prepared inputs pass through."""
        if inputs.language is not None or not inputs.has_image or self.kernels != "fast" \
                or inputs.positions is not None or not self.causal_images:
            return inputs
        return encode_images(self, inputs)

    def _build_inputs(self, messages: list[Message], image: Image.Image | None) -> ModelInputs:
        text = self.processor.apply_chat_template(with_image(messages, image), add_generation_prompt=True,
                                                  tokenize=False)
        encoded = self.processor(text=[text], images=[image] if image is not None else None, return_tensors="pt")
        encoded = dict(encoded)
        input_ids = encoded.pop("input_ids")
        return ModelInputs(input_ids=input_ids, extra=encoded, has_image=image is not None)


class QwenVLTarget(_VisionLanguageTarget):
    """Qwen2-VL and Qwen2.5-VL: 3-D M-RoPE positions.

    Prefill positions come from the model's own ``get_rope_index``; every later token is
    text, so its three M-RoPE coordinates are equal: cached length + depth + the rope delta
    computed at prefill (kept here, since ``generate()`` overwrites the model's copy).
    """

    family = "qwen-vl"

    def _image_token_ids(self) -> list[int]:
        config = self.model.config
        names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        return [int(getattr(config, n)) for n in names if getattr(config, n, None) is not None]

    def prompt_positions(self, inputs: ModelInputs) -> tuple[torch.Tensor, int]:
        extra = inputs.extra
        if inputs.positions is not None:  # (3, 1, P) M-RoPE positions from generate()
            return inputs.positions.to(self.device), int(inputs.positions.max()) + 1 - inputs.input_ids.shape[1]
        if extra.get("image_grid_thw") is None:
            return super().prompt_positions(inputs)
        positions, deltas = self.model.model.get_rope_index(
            inputs.input_ids, mm_token_type_ids=extra["mm_token_type_ids"], image_grid_thw=extra["image_grid_thw"],
            attention_mask=extra.get("attention_mask"))
        return positions.to(self.device), int(deltas.reshape(-1)[0])


class LlavaTarget(_VisionLanguageTarget):
    """LLaVA-1.5 and LLaVA-NeXT: the processor expands ``<image>`` into one placeholder per
    image feature, so positions are a plain arange."""

    family = "llava"

    def _image_token_ids(self) -> list[int]:
        return [int(self.model.config.image_token_id)]


class GemmaVLTarget(_VisionLanguageTarget):
    """Gemma 3 VLMs (`Gemma3ForConditionalGeneration`): the processor expands an image into
    begin-of-image, ``mm_tokens_per_image`` soft tokens and end-of-image; positions are a
    plain arange; the soft tokens of one image attend to each other both ways at prefill
    (``token_type_ids``), hence `causal_images` False. Later tokens are text: causal, with
    the language model's sliding windows."""

    family = "gemma3"
    causal_images = False

    def _image_token_ids(self) -> list[int]:
        config = self.model.config
        names = ("image_token_id", "boi_token_id", "eoi_token_id")
        return [int(getattr(config, n)) for n in names if getattr(config, n, None) is not None]
