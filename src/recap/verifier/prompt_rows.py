"""Which prompt rows a prefill computes, and the rows it reports.

A request asks for ``all`` of them (the default), ``first`` (RECAP-paper, tree recycling:
they seed token-keyed memories from each eligible token's first row), ``answers`` (RECAP:
those first rows inside earlier assistant turns, found from the chat template's assistant
header) or ``none`` (AR, PLD, SAM, lookahead, token recycling); the prefill runs the LM head on
those rows and the last one alone, as `model.generate` does for the last (``logits_to_keep``):
the head is about a fifth of a prompt row's arithmetic on SmolLM2 (more with a larger
vocabulary), an image's placeholder rows are never read, and a method should not pay for what
only another method uses. Rows not computed are `recap.core.NOT_COMPUTED` (``none``: empty
arrays)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from recap.core import NOT_COMPUTED, RowsWanted, first_eligible

if TYPE_CHECKING:
    from recap.verifier.base import TargetModel

ANSWER_PROBE = "alpha beta gamma"
"""The assistant turn of the probe conversation `TargetModel.answer_header` checks itself on."""


def after_headers(prompt: np.ndarray, header: tuple[int, ...], special: set[int]) -> np.ndarray:
    """(P,) bool: the positions after each occurrence of ``header`` up to the next special
    token (or the end); all False for an empty header."""
    mask = np.zeros(len(prompt), dtype=bool)
    if not header:
        return mask
    width = len(header)
    stops = np.append(np.flatnonzero(np.isin(prompt, list(special))), len(prompt))
    for start in np.flatnonzero(prompt == header[0]).tolist():
        begin = start + width
        if tuple(prompt[start:begin].tolist()) == header:
            mask[begin:stops[np.searchsorted(stops, begin)]] = True
    return mask


def answer_header(target: TargetModel) -> tuple[int, ...]:
    """The tokens that open an assistant turn in this model's chat prompts: what the chat
    template adds after a user turn, from its last special token on (ChatML's
    ``<|im_start|>assistant\n``). Checked on a probe conversation whose assistant turn
    `answer_mask` must find exactly; empty where the template has no such header or the
    probe fails (then nothing counts as an earlier answer)."""
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": ANSWER_PROBE},
             {"role": "user", "content": "y"}]
    try:
        opened = target._build_inputs(probe[:1], None).input_ids[0].tolist()
        whole = target._build_inputs(probe, None).input_ids[0].tolist()
    except Exception:  # noqa: BLE001 - a template that cannot render the probe has no known header
        return ()
    special = target._special_ids()
    marks = [i for i, token in enumerate(opened) if token in special]
    if not marks or whole[:len(opened)] != opened:
        return ()
    header = tuple(opened[marks[-1]:])
    whole = np.asarray(whole)
    found = whole[after_headers(whole, header, special)]
    return header if target.tokenizer.decode(found.tolist()).strip() == ANSWER_PROBE else ()


def wanted_positions(prompt: np.ndarray, rows: RowsWanted, eligible: np.ndarray,
                     answer_mask: Callable[[np.ndarray], np.ndarray]) -> np.ndarray | None:
    """The positions (ascending) whose logits a prefill computes for ``rows``: None for
    ``all``; the last row always."""
    if rows == "all":
        return None
    last = np.array([len(prompt) - 1], np.int64)
    if rows == "none":
        return last
    firsts = first_eligible(prompt, eligible)
    if rows == "answers":
        firsts = firsts[answer_mask(prompt)[firsts]]
    return np.union1d(firsts, last).astype(np.int64)


def spread_rows(length: int, positions: np.ndarray | None, topk_ids: np.ndarray,
                topk_logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(length, K) Top-K arrays holding the rows computed at ``positions`` (None: all of
    them, as they are), every other row `recap.core.NOT_COMPUTED`."""
    if positions is None:
        return topk_ids, topk_logits
    ids = np.full((length, topk_ids.shape[1]), NOT_COMPUTED, np.int64)
    logits = np.full((length, topk_ids.shape[1]), -np.inf, np.float32)
    ids[positions], logits[positions] = topk_ids, topk_logits
    return ids, logits


def no_prompt_rows(top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The (0, K) Top-K arrays of a prefill that kept no prompt rows."""
    return np.zeros((0, top_k), np.int64), np.zeros((0, top_k), np.float32)
