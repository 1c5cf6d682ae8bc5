"""What a prompt becomes before the language model runs it: `ModelInputs` (the model's own
forward arguments) and, for an image prompt on the fast kernels, `LanguageInputs` (the
language model's input vectors, taken from the model's own forward by `encode_images`)."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from recap.verifier.kernels.args import language_model

if TYPE_CHECKING:
    from recap.verifier.base import TargetModel

Message = dict[str, Any]


@dataclass
class ModelInputs:
    """Everything prefill needs for one request, as the model's forward takes it."""

    input_ids: torch.Tensor
    """(1, P) prompt token ids."""
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """Further forward arguments (attention_mask, pixel_values, image_grid_thw, ...)."""
    has_image: bool = False
    positions: torch.Tensor | None = None
    """Prompt position ids computed by the caller (``generate()`` hands M-RoPE ones to a
    custom loop after popping the image grid); None: the adapter computes them."""
    language: LanguageInputs | None = None
    """The prompt as the language model takes it, once `encode_images` has run the vision
    tower (the fast kernels then prefill an image prompt in chunks)."""

    @property
    def prompt_ids(self) -> list[int]:
        return self.input_ids[0].tolist()

    def on(self, device: torch.device) -> dict[str, Any]:
        """``extra`` with its tensors on ``device``."""
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.extra.items()}

    @property
    def padded(self) -> bool:
        """Whether an attention mask hides some positions (then transformers' forward runs it whole)."""
        mask = self.extra.get("attention_mask")
        return mask is not None and not bool(mask.all())


@dataclass
class LanguageInputs:
    """An image prompt after the vision tower: what its language model's forward receives,
    taken from the model's own code (image features merged into the token embeddings)."""

    embeds: np.ndarray
    """(P, hidden) float32 input vectors."""
    positions: np.ndarray
    """(P,) RoPE positions, or (P, 3) M-RoPE coordinates."""
    rope_offset: int
    """What later (text) positions add to the cached length."""
    first_image_row: int
    """Rows before it are text: a prefix cache may share them with other prompts."""


class _Captured(Exception):
    """Stops a VLM's forward once its language model's inputs are known."""


def flatten_text(messages: list[Message]) -> str:
    """The text of chat messages (string contents and ``text`` items), space-joined."""
    parts = []
    for message in messages:
        content = message.get("content", "")
        if isinstance(content, str):
            parts.append(content)
        else:
            parts.extend(item.get("text", "") for item in content if isinstance(item, dict))
    return " ".join(parts)


@torch.inference_mode()
def encode_images(target: TargetModel, inputs: ModelInputs) -> ModelInputs:
    """``inputs`` with `LanguageInputs`: the vision tower run now, in the caller's thread,
    stopped at the language model's input (a forward pre-hook), so every family merges its
    image features as transformers does. The server calls this while it prepares a request,
    so the decoding thread only prefills the language rows. One encode at a time: the
    others wait rather than take the decoder's core."""
    decoder = language_model(target.model)
    positions, offset = target.prompt_positions(inputs)
    seen: dict[str, torch.Tensor] = {}
    caller = threading.get_ident()

    def take(module, args, kwargs):  # another thread's forward on this model passes through
        if threading.get_ident() != caller:
            return None
        seen.update(embeds=kwargs.get("inputs_embeds"), positions=kwargs.get("position_ids"))
        raise _Captured

    with target.encode_lock:
        handle = decoder.register_forward_pre_hook(take, with_kwargs=True)
        try:
            target.model(input_ids=inputs.input_ids.to(target.device), position_ids=positions, use_cache=False,
                         **inputs.on(target.device))
        except _Captured:
            pass
        finally:
            handle.remove()
    if seen.get("embeds") is None:
        raise RuntimeError(f"{target.name}: the language model's input embeddings could not be taken")
    taken = seen["positions"] if seen.get("positions") is not None else positions
    taken = taken.reshape(-1, taken.shape[-1])[-3:] if taken.ndim == 3 else taken.reshape(1, -1)
    rows = taken[0] if taken.shape[0] == 1 else taken.T  # (P,) or (P, 3)
    image_rows = np.flatnonzero(np.isin(inputs.input_ids[0].numpy(), list(target.excluded_tokens)))
    language = LanguageInputs(
        embeds=np.ascontiguousarray(seen["embeds"][0].float().numpy()),
        positions=np.ascontiguousarray(rows.cpu().numpy().astype(np.int64)), rope_offset=int(offset),
        first_image_row=int(image_rows[0]) if len(image_rows) else inputs.input_ids.shape[1])
    if inputs.padded:  # `prefill` runs transformers' forward: it needs the pixels
        return dataclasses.replace(inputs, language=language)
    # the pixels have become the language rows: a queued request (a server's) need not keep them
    kept = {name: value for name, value in inputs.extra.items() if not name.startswith("pixel_values")}
    return dataclasses.replace(inputs, language=language, extra=kept)
