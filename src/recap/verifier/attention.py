"""The three pieces of tree verification that stock transformers does not do for us.

- an additive 4-D mask so each packed node sees the cached prefix and its own ancestors only;
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
