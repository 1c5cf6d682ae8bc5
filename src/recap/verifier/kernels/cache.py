"""A KV cache that grows in place: per layer, keys and values of shape (H_kv, capacity, D),
written at explicit slots. A step writes its packed nodes at slots past..past+N-1; committing
copies the accepted nodes' rows to the slots right after the prefix (the prefix itself is
never copied), so the cache then equals plain decoding's."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from recap.verifier.kernels.args import DecoderArgs


class KVCache:
    def __init__(self, args: DecoderArgs, capacity: int):
        self.args = args
        self.length = 0
        """Committed positions (the prefix every node of the next step sees)."""
        shape = (args.layers, args.kv_heads, max(capacity, 16), args.head_dim)
        self.keys = np.zeros(shape, np.float32)
        self.values = np.zeros(shape, np.float32)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` more slots past the prefix (doubling: rare, amortised)."""
        need = self.length + rows
        if need <= self.capacity:
            return
        capacity = max(need, 2 * self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = np.zeros(old.shape[:2] + (capacity,) + old.shape[3:], np.float32)
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def load(self, keys: Sequence[np.ndarray], values: Sequence[np.ndarray], length: int) -> None:
        """Take a prefill's cache: per layer (H_kv, length, D) arrays."""
        self.reserve(length - self.length)
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.keys[layer, :, :length] = k
            self.values[layer, :, :length] = v
        self.length = length

    def commit(self, keep: Sequence[int]) -> None:
        """Keep packed positions ``keep`` (ascending, root = 0) of the last step."""
        past = self.length
        for slot, source in enumerate(keep):
            if source != slot:
                self.keys[:, :, past + slot] = self.keys[:, :, past + source]
                self.values[:, :, past + slot] = self.values[:, :, past + source]
        self.length = past + len(keep)
