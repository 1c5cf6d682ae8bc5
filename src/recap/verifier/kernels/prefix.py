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
from typing import TYPE_CHECKING

import numpy as np
import torch

from recap.core import NOT_COMPUTED, ROWS_WANTED
from recap.verifier import acceptance
from recap.verifier.kernels.cache import KVCache
from recap.verifier.prompt_rows import no_prompt_rows

if TYPE_CHECKING:
    from recap.core import PromptRows, RowsWanted
    from recap.verifier.fast import FastLane
    from recap.verifier.inputs import LanguageInputs
    from recap.verifier.sampling import Sampler

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
    rows: RowsWanted
    """Which Top-K rows its prefill computed (`recap.core.RowsWanted`)."""
    topk_ids: np.ndarray | None
    topk_logits: np.ndarray | None
    """(P, K) its Top-K rows (what `PromptRows` carries), those not computed
    `recap.core.NOT_COMPUTED`; None where ``rows`` is ``none``."""


def _covers(computed: RowsWanted, wanted: RowsWanted) -> bool:
    """Whether a prefill that computed ``computed`` rows has every row ``wanted`` asks for: the
    store's rule (an entry never gives way to one with fewer rows). Lookups read the rows
    themselves (`PrefixCache.lookup`)."""
    return ROWS_WANTED.index(computed) >= ROWS_WANTED.index(wanted)


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

    def copy(self) -> PrefixCache:
        """A cache holding the same entries (shared: an entry is never changed once stored), so
        that a benchmark can time a prompt again from the cache it met the first time."""
        twin = PrefixCache(self.max_tokens)
        twin._entries = OrderedDict(self._entries)
        twin._next, twin.hits, twin.reused_tokens = self._next, self.hits, self.reused_tokens
        return twin

    def lookup(self, tokens: np.ndarray, limit: int, scope: str = "",
               wanted: np.ndarray | None = None) -> tuple[int, _Entry | None]:
        """(usable length, entry): the longest prefix of ``tokens`` held in ``scope``, at most
        ``limit`` rows, cut before the first row ``wanted`` (per position: the prefill reads
        its Top-K row) that the entry did not compute. An entry serves the rows it holds, read
        from its arrays, not from its label: a prefill never copies a row it needs as missing."""
        best, best_key = 0, None
        for key, entry in self._entries.items():
            if entry.scope != scope:
                continue
            length = min(len(entry.tokens), len(tokens), limit)
            differ = np.flatnonzero(entry.tokens[:length] != tokens[:length])
            shared = int(differ[0]) if len(differ) else length
            if wanted is not None and shared:
                held = np.zeros(shared, bool) if entry.topk_ids is None else entry.topk_ids[:shared, 0] != NOT_COMPUTED
                lacking = np.flatnonzero(np.asarray(wanted[:shared], bool) & ~held)
                shared = int(lacking[0]) if len(lacking) else shared
            if shared > best:
                best, best_key = shared, key
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.reused_tokens += best
        return best, self._entries[best_key]

    def store(self, tokens: np.ndarray, cache: KVCache, topk_ids: np.ndarray | None,
              topk_logits: np.ndarray | None, scope: str = "", rows: RowsWanted = "all") -> None:
        """Keep a prefilled prompt (its rows copied out of ``cache``) for ``scope``; ``rows``:
        which Top-K rows it computed (Top-K None for ``none``). It replaces the held entries it
        extends whose rows it covers, never one that has more rows."""
        length = len(tokens)
        if length > self.max_tokens or length == 0:
            return
        for key, entry in list(self._entries.items()):  # a prompt that extends a held one replaces it
            if entry.scope == scope and len(entry.tokens) <= length and \
                    np.array_equal(entry.tokens, tokens[: len(entry.tokens)]) and _covers(rows, entry.rows):
                del self._entries[key]
        top = (None, None) if rows == "none" else (topk_ids.copy(), topk_logits.copy())
        self._entries[self._next] = _Entry(scope, tokens.copy(), cache.keys[:, :, :length].copy(),
                                           cache.values[:, :, :length].copy(), rows, *top)
        self._next += 1
        while self.tokens > self.max_tokens:
            self._entries.popitem(last=False)


class ChunkedPrefill:
    """One text prompt's prefill on a lane, run as chunks of a chain: by ``TargetModel.prefill``
    one forward per chunk, or by a batch inside its steps beside other requests' trees
    (`recap.verifier.batch.verify_batch`), so a newcomer's prefill holds the running requests
    back by one chunk per step at most. Rows shared with a recent prompt of the same scope are
    copied from the lane's `PrefixCache` first; the last row is always computed.

    The cache is asked when the first chunk is about to run, not when the request is admitted,
    and every chunk publishes the rows computed so far: requests admitted together (a burst of
    clients with one system prompt) then compute the shared prefix once, not once each.

    The Top-K rows are computed for the positions the lane was asked to keep
    (`TargetModel.keep_prompt_rows`: all of them, each eligible token's first, those of them
    inside earlier answers, or none) and
    the last one (`logit_rows`); `PromptRows` carries the others as `recap.core.NOT_COMPUTED`
    (empty arrays for none)."""

    def __init__(self, lane: FastLane, prompt: np.ndarray, rows_kept: RowsWanted = "all",
                 language: LanguageInputs | None = None):
        self.lane, self.prompt, self.language = lane, prompt, language
        target = lane.target
        image_token = target.image_token
        lane.start_prompt(len(prompt), 0 if language is None else language.rope_offset,
                          None if language is None or image_token is None else np.flatnonzero(prompt == image_token))
        self._image_attention: float | None = None
        self.rows_kept = rows_kept
        """Which prompt rows' Top-K are computed (`recap.core.RowsWanted`; the last row always)."""
        picked = target.wanted_positions(prompt, rows_kept)
        self._wanted = np.ones(len(prompt), bool)
        """Per prompt position: whether its row's logits are computed."""
        if picked is not None:
            self._wanted[:] = False
            self._wanted[picked] = True
        width = target.top_k
        self._ids = np.full((len(prompt), width), NOT_COMPUTED, np.int64)
        self._logits = np.full((len(prompt), width), -np.inf, np.float32)
        """(P, K) the Top-K rows so far (copied from the prefix cache or computed)."""
        self._shareable = len(prompt) if language is None else language.first_image_row
        """Rows another prompt with the same tokens has too (an image's rows are not: its
        placeholder tokens are the same for every image)."""
        self._looked_up = False
        self._last: torch.Tensor | None = None
        self._greedy = -1
        self._chunk = 0

    def _reuse(self) -> None:
        """Copy the longest prefix the cache holds for this prompt's scope (once, before the
        first chunk)."""
        if self._looked_up:
            return
        self._looked_up = True
        lane = self.lane
        reused, entry = lane.runner.prefix_cache.lookup(self.prompt, min(len(self.prompt) - 1, self._shareable),
                                                        lane.target.prefix_scope, wanted=self._wanted)
        if reused:
            lane.load_prefix(entry.keys[:, :, :reused], entry.values[:, :, :reused], reused)
            if entry.topk_ids is not None:
                self._ids[:reused], self._logits[:reused] = entry.topk_ids[:reused], entry.topk_logits[:reused]

    @property
    def finished(self) -> bool:
        return self.lane.past_len == len(self.prompt)

    @property
    def left(self) -> int:
        """Prompt rows still to compute."""
        self._reuse()
        return len(self.prompt) - self.lane.past_len

    def rows(self, budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The next chunk, at most ``budget`` rows: tokens, RoPE positions ((n,), or (n, 3)
        M-RoPE coordinates), CSR ancestor lists. `embeds` gives its input vectors."""
        self._reuse()
        done = self.lane.past_len
        tokens = self.prompt[done:done + max(1, budget)]
        self._chunk = len(tokens)
        starts, paths = chain(len(tokens))
        positions = np.arange(done, done + len(tokens), dtype=np.int64) if self.language is None else \
            self.language.positions[done:done + len(tokens)]
        return tokens, positions, starts, paths

    def logit_rows(self) -> np.ndarray | None:
        """The current chunk's rows whose logits `absorb` reads (chunk-local, ascending); None:
        all of them."""
        if self.rows_kept == "all":
            return None
        done = self.lane.past_len
        return np.flatnonzero(self._wanted[done:done + self._chunk]).astype(np.int64)

    def embeds(self) -> np.ndarray | None:
        """The current chunk's input vectors (n, hidden) for an image prompt; None: its
        tokens' embeddings."""
        if self.language is None:
            return None
        done = self.lane.past_len
        return self.language.embeds[done:done + self._chunk]

    def absorb(self, logits: np.ndarray, first_row: int = 0) -> None:
        """Take the chunk's logits (n, V), rows ``first_row``.. of the step: keep its K/V, its
        Top-K rows, and at the end the last row's logits (and, with SAM+ViSkip's capture on,
        its attention on the image). The rows so far go into the prefix cache (a longer entry
        of the same prompt replaces a shorter one)."""
        lane = self.lane
        done = lane.past_len
        lane.keep_chunk(self._chunk)
        kv = lane.kv
        capture = lane.target.capture
        if self.finished and capture is not None and capture.enabled and lane.image_positions is not None:
            self._image_attention = lane.decoder.root_image_attention(
                kv, lane.image_positions, first_row + self._chunk - 1, keys=kv.length)
        picked = np.flatnonzero(self._wanted[done:done + self._chunk])  # the rows computed (the last always)
        if len(picked):
            top_ids, top_logits, argmax = acceptance.top_rows(torch.from_numpy(logits[picked]), lane.target.top_k)
            self._ids[done + picked], self._logits[done + picked] = top_ids, top_logits
            if self.finished:
                self._last, self._greedy = torch.from_numpy(logits[-1].copy()), int(argmax[-1])
        shared = min(lane.past_len, self._shareable)
        if done < self._shareable:  # this chunk added shareable rows
            lane.runner.prefix_cache.store(self.prompt[:shared], kv, self._ids[:shared], self._logits[:shared],
                                           lane.target.prefix_scope, self.rows_kept)

    def result(self, sampler: Sampler | None = None) -> tuple[PromptRows, int]:
        """What ``prefill`` returns: the prompt's rows and the first token."""
        first = self._greedy if sampler is None else sampler.token(self._last, 0)
        target = self.lane.target
        if self.rows_kept == "none":
            ids, logits = no_prompt_rows(target.top_k)
        else:
            ids, logits = self._ids, self._logits
        return target.report_prompt(self.prompt, ids, logits, self._image_attention), first
