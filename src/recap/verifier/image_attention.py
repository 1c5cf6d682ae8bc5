"""Opt-in capture of how much the target attends to the image (for SAM+ViSkip's gate).

What is measured: in the final decoder layer of the *language* model, for one query row
(prefill: the last prompt position; verification: packed query 0, the tree's root), the
softmax attention weights over all keys (cached prefix + the forward's own tokens), averaged
over heads, summed over the key positions that hold the prompt's image placeholder tokens
(``config.image_token_id`` in the prompt's input ids; the vision features sit in exactly
those positions, and they stay in place in the KV cache, whose compaction only moves entries
after the prompt).

How, without forking modeling code: transformers 5.x attention modules look their kernel up
at every call, ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``.
We register one more implementation, ``recap-image-attention-<original>`` (plus the same
name in ``AttentionMaskInterface``, mapped to the original's mask builder, so the masks the
model builds are the same objects as before), and switch only the language decoder's config
to it (``decoder.set_attn_implementation``: the vision tower has its own sub-config and keeps
its implementation). The registered function first calls the original kernel with the very
same arguments, so outputs are bit-identical; then, only for the one attention module
captured (the last ``self_attn`` of the decoder, found by object identity in a weak
registry), it recomputes the single query row in float32: ``q . k^T * scaling`` with the key
heads repeated for GQA (head h uses key head h // groups), plus the layer's 4-D mask
(additive float: added; boolean: False -> -inf; none: causal), softmax over keys, mean over
heads, sum over image positions. Every other module, and the captured one while no row is
requested, costs one dictionary lookup.

Disabling switches the decoder back to its original implementation, so a target that never
captures runs exactly the stock code. Supported originals: ``sdpa`` and ``eager`` (the model
module's own ``eager_attention_forward``); other kernels (flash, flex) report no capture.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PREFIX = "recap-image-attention-"
SUPPORTED = ("sdpa", "eager")

_CAPTURES: weakref.WeakKeyDictionary[torch.nn.Module, ImageAttentionCapture] = weakref.WeakKeyDictionary()


def _original_kernel(original: str, module: torch.nn.Module) -> Callable[..., Any]:
    if original == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[original]


def _make_delegate(original: str) -> Callable[..., Any]:
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:
        out = _original_kernel(original, module)(module, query, key, value, attention_mask, **kwargs)
        capture = _CAPTURES.get(module)
        if capture is not None and capture.positions is not None:
            capture.record(module, query, key, attention_mask, kwargs)
        return out

    attention.__doc__ = f"{original} attention, plus RECAP's image-attention row for one captured module."
    return attention


def _register(original: str) -> str:
    name = PREFIX + original
    if name not in ALL_ATTENTION_FUNCTIONS.valid_keys():
        AttentionInterface.register(name, _make_delegate(original))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    return name


class ImageAttentionCapture:
    """The capture for one model: switched on and off as a whole, armed per request."""

    def __init__(self, decoder: Any, module: torch.nn.Module):
        self.decoder = decoder
        self.module = module
        self.original: str | None = None
        self.positions: torch.Tensor | None = None
        """Key positions of the image tokens; None: nothing to measure (capture idle)."""
        self.query_row = -1
        self.value: float | None = None

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> ImageAttentionCapture | None:
        """The capture for ``model``'s language decoder, or None if its layout is not the
        usual ``get_decoder().layers[i].self_attn``."""
        try:
            decoder = model.get_decoder()
            module = decoder.layers[-1].self_attn
        except (AttributeError, IndexError, TypeError):
            return None
        if not hasattr(decoder, "set_attn_implementation"):
            return None
        return cls(decoder, module)

    @property
    def enabled(self) -> bool:
        return self.original is not None

    def enable(self) -> bool:
        """Route the decoder's attention through the delegate; False if its kernel is not supported."""
        if self.enabled:
            return True
        current = self.decoder.config._attn_implementation
        if current not in SUPPORTED:
            return False
        self.decoder.set_attn_implementation(_register(current))
        self.original = current
        _CAPTURES[self.module] = self
        return True

    def disable(self) -> None:
        """Back to the stock kernel: no capture code runs at all."""
        if self.enabled:
            self.decoder.set_attn_implementation(self.original)
            self.original = None
            self.positions = None
            _CAPTURES.pop(self.module, None)

    def arm(self, positions: torch.Tensor | None, query_row: int) -> None:
        """Measure query ``query_row`` (negative counts from the end) of the next forward."""
        self.positions = positions if self.enabled and positions is not None and len(positions) else None
        self.query_row = query_row
        self.value = None

    def take(self) -> float | None:
        """The value of the last forward (None if nothing was measured), then reset."""
        value, self.value = self.value, None
        return value

    @torch.no_grad()
    def record(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               mask: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
        q_len, kv_len = query.shape[2], key.shape[2]
        row = self.query_row % q_len
        q = query[0, :, row].float()                              # (H, D)
        k = key[0].float()                                        # (H_kv, S, D)
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)  # GQA: head h reads key head h // groups
        scaling = kwargs.get("scaling")
        if scaling is None:
            scaling = getattr(module, "scaling", q.shape[-1] ** -0.5)
        scores = torch.einsum("hd,hsd->hs", q, k) * scaling
        if mask is not None:
            row_mask = mask[0, :, row, :kv_len]                   # (1 or H, S)
            if row_mask.dtype == torch.bool:
                scores = scores.masked_fill(~row_mask, float("-inf"))
            else:
                scores = scores + row_mask.float()
        elif q_len > 1 and kwargs.get("is_causal", getattr(module, "is_causal", True)):
            scores[:, row + kv_len - q_len + 1 :] = float("-inf")
        probs = torch.softmax(scores, dim=-1)
        self.value = float(probs[:, self.positions.to(probs.device)].sum(dim=-1).mean())
