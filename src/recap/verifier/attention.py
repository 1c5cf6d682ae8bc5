"""The three pieces of tree verification that stock transformers does not do for us.

- an additive 4-D mask so each packed node sees the cached prefix and its own ancestors only
  (for a model with sliding-window layers, one per layer type: a sliding layer's node sees
  only the positions its window reaches, as a plain step there does);
- explicit positions (cached length + depth), since a causal arange would be wrong for a tree;
- KV compaction: keep the root and the accepted path, drop rejected branches.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache

from recap.core.tree import additive_mask


def tree_attention_mask(allowed: np.ndarray, past_len: int, dtype: torch.dtype,
                        device: torch.device | str) -> torch.Tensor:
    """Additive float mask of shape (1, 1, N, past_len + N) in the model's dtype.

    ``allowed`` is the (N, N) ancestor-or-self matrix of the packed tree. Columns of the
    cached prefix are always visible. A boolean mask would be silently wrong under eager
    attention, hence 0 / ``finfo.min``.
    """
    mask = additive_mask(allowed, past_len, torch.finfo(dtype).min)
    return torch.from_numpy(mask).to(device=device, dtype=dtype)[None, None]


def windowed(allowed: np.ndarray, depths: np.ndarray, past_len: int, window: int) -> np.ndarray:
    """(N, past_len + N) bool: what each packed node of a sliding-window layer may attend:
    its ancestors-or-self (``allowed``) and the cached prefix, each only where Hugging Face's
    sliding mask lets a query at the node's position see it (``key > query - window``, the
    node at past_len + depth, ancestor a at past_len + depth[a])."""
    n = len(depths)
    query = past_len + np.asarray(depths, np.int64)[:, None]
    keys = np.concatenate([np.arange(past_len, dtype=np.int64), past_len + np.asarray(depths, np.int64)])[None]
    seen = np.concatenate([np.ones((n, past_len), bool), np.asarray(allowed, bool)], axis=1)
    return seen & (keys > query - window)


def tree_attention_masks(allowed: np.ndarray, depths: np.ndarray, past_len: int, window: int, dtype: torch.dtype,
                         device: torch.device | str) -> dict[str, torch.Tensor]:
    """The tree's masks by layer type, for a model whose layers are full or sliding-window
    (``config.layer_types``; its forward takes this mapping in place of one mask)."""
    blocked = torch.finfo(dtype).min
    sliding = np.where(windowed(allowed, depths, past_len, window), np.float32(0.0), np.float32(blocked))
    return {"full_attention": tree_attention_mask(allowed, past_len, dtype, device),
            "sliding_attention": torch.from_numpy(sliding).to(device=device, dtype=dtype)[None, None]}


def tree_positions(depths: np.ndarray, past_len: int, offset: int = 0,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """Position ids (1, N): cached length + depth (root depth 0) + a per-request offset
    (Qwen-VL's M-RoPE delta; 0 elsewhere)."""
    return torch.from_numpy(np.asarray(depths, dtype=np.int64) + (past_len + offset)).to(device)[None]


def compact_cache(cache: DynamicCache, past_len: int, keep: list[int], packed: int) -> None:
    """Keep packed positions ``keep`` (ascending, root = 0) of the last ``packed`` entries.

    Their K/V slices move to the slots right after the prefix, then the tail is cropped:
    the cache then equals what feeding the kept tokens one by one would have produced.
    """
    kept = len(keep)
    if keep != list(range(kept)):
        source = torch.tensor(keep, dtype=torch.long) + past_len
        for layer in cache.layers:
            source = source.to(layer.keys.device)
            layer.keys[:, :, past_len : past_len + kept] = layer.keys.index_select(2, source)
            layer.values[:, :, past_len : past_len + kept] = layer.values.index_select(2, source)
    if packed > kept:
        cache.crop(-(packed - kept))
