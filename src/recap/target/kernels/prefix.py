"""Prefill on the fast kernels, and a cache of recent prompts' KV rows for shared prefixes.

A prompt is prefilled as chunks of a chain: each row attends to the cached prefix and to the
rows before it in the chunk, in position order, through the same batch-invariant kernels as
a decode step. Row p's K/V and logits are therefore those of a one-token step at position p,
bit for bit, whatever the chunk size, and whether rows 0..p-1 were computed in this request
or copied from an earlier prompt that began with the same tokens. That is what makes prefix
reuse exact by construction (not merely close, as with kernels whose arithmetic follows the
row count): a chat template and system prompt shared by every request are computed once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from recap.target.kernels.cache import KVCache

PREFILL_CHUNK = 64
"""Prompt rows per prefill forward: bounds the step buffers (and, in a server, how long one
prefill chunk holds the other requests back)."""


def chain(count: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR ancestor lists of a chain of ``count`` rows: row i's path is rows 0..i."""
    starts = np.zeros(count + 1, np.int64)
    np.cumsum(np.arange(1, count + 1), out=starts[1:])
    paths = np.concatenate([np.arange(i + 1, dtype=np.int64) for i in range(count)]) if count else \
        np.zeros(0, np.int64)
    return starts, paths


@dataclass
class _Entry:
    scope: str
    """Who may reuse it (`recap serve`: the tenant), so that no one can time another's prompts."""
    tokens: np.ndarray
    """(P,) the prompt."""
    keys: np.ndarray
    values: np.ndarray
    """(layers, H_kv, P, D) its K/V rows."""
    topk_ids: np.ndarray
    topk_logits: np.ndarray
    """(P, K) its Top-K rows (what `PromptRows` carries for every prompt position)."""


class PrefixCache:
    """The KV and Top-K rows of recent prompts, least recently used dropped past ``max_tokens``
    rows in all. ``lookup`` finds the longest prefix a new prompt shares with one of them in
    the same ``scope``: a server scopes by tenant, since a prefill that runs faster because
    a prefix is cached would tell one tenant what another's prompts begin with."""

    def __init__(self, max_tokens: int = 4096):
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        self.hits = 0
        self.reused_tokens = 0

    @property
    def tokens(self) -> int:
        return sum(len(entry.tokens) for entry in self._entries.values())

    def clear(self) -> None:
        self._entries.clear()

    def lookup(self, tokens: np.ndarray, limit: int, scope: str = "") -> tuple[int, _Entry | None]:
        """(shared length, entry): the longest prefix of ``tokens`` held in ``scope``, at most
        ``limit`` rows."""
        best, best_key = 0, None
        for key, entry in self._entries.items():
            if entry.scope != scope:
                continue
            length = min(len(entry.tokens), len(tokens), limit)
            differ = np.flatnonzero(entry.tokens[:length] != tokens[:length])
            shared = int(differ[0]) if len(differ) else length
            if shared > best:
                best, best_key = shared, key
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.reused_tokens += best
        return best, self._entries[best_key]

    def store(self, tokens: np.ndarray, cache: KVCache, topk_ids: np.ndarray, topk_logits: np.ndarray,
              scope: str = "") -> None:
        """Keep a prefilled prompt (its rows copied out of ``cache``) for ``scope``."""
        length = len(tokens)
        if length > self.max_tokens or length == 0:
            return
        for key, entry in list(self._entries.items()):  # a prompt that extends a held one replaces it
            if entry.scope == scope and len(entry.tokens) <= length and \
                    np.array_equal(entry.tokens, tokens[: len(entry.tokens)]):
                del self._entries[key]
        self._entries[self._next] = _Entry(scope, tokens.copy(), cache.keys[:, :, :length].copy(),
                                           cache.values[:, :, :length].copy(), topk_ids.copy(), topk_logits.copy())
        self._next += 1
        while self.tokens > self.max_tokens:
            self._entries.popitem(last=False)
