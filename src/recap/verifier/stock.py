"""One request on transformers' own forward (the stock kernels): a `StockLane` holds its
KV cache and positions, prefills the prompt, verifies a packed tree with an explicit mask
and positions (`recap.verifier.attention`) and keeps the accepted entries. Lanes on the stock
path are verified one at a time; the fast path (`recap.verifier.fast`) batches them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, GenerationConfig

from recap.core import DraftTree, PromptRows, RowsWanted, VerifiedTree
from recap.errors import InputError
from recap.verifier import acceptance
from recap.verifier.attention import compact_cache, tree_attention_mask, tree_attention_masks, tree_positions
from recap.verifier.image_attention import ImageAttentionCapture
from recap.verifier.inputs import ModelInputs
from recap.verifier.prompt_rows import no_prompt_rows, spread_rows
from recap.verifier.sampling import Sampler

if TYPE_CHECKING:
    from recap.verifier.base import TargetModel


class StockLane:
    """One request's state on the stock path; only its own methods write it."""

    def __init__(self, target: TargetModel):
        self.target = target
        self.cache: DynamicCache | None = None
        self.past_len = 0
        """Tokens whose K/V are cached."""
        self.position_offset = 0
        """What M-RoPE adds to the cached length for later positions."""
        self.image_positions: torch.Tensor | None = None
        """The prompt's image placeholder positions, while the image-attention capture is on."""
        self._packed = 0

    @property
    def holds_cache(self) -> bool:
        return self.cache is not None

    def _arm_capture(self, query_row: int, input_ids: torch.Tensor | None = None) -> ImageAttentionCapture | None:
        """Ask the capture for one query row of the next forward; prefill also gives the prompt
        ids, whose image positions are kept for the request."""
        capture = self.target.capture
        if capture is None or not capture.enabled:
            return None
        if input_ids is not None:
            self.image_positions = (input_ids[0] == self.target.image_token).nonzero().flatten()
        capture.arm(self.image_positions, query_row)
        return capture

    @torch.inference_mode()
    def prefill(self, inputs: ModelInputs, wanted: RowsWanted, sampler: Sampler | None) -> tuple[PromptRows, int]:
        """The prompt in one forward; its Top-K rows at the positions ``wanted`` asks for and
        the first token (greedy, or drawn by ``sampler``)."""
        target = self.target
        self._packed = 0
        self.cache = DynamicCache()
        input_ids = inputs.input_ids.to(target.device)
        extra = inputs.on(target.device)
        positions, self.position_offset = target.prompt_positions(inputs)
        capture = self._arm_capture(-1, input_ids)
        picked = target.wanted_positions(input_ids[0].cpu().numpy(), wanted)
        if picked is not None and target.keeps_logits:
            extra["logits_to_keep"] = 1 if len(picked) == 1 else torch.from_numpy(picked).to(target.device)
        out = target.model(input_ids=input_ids, position_ids=positions, cache=self.cache, use_cache=True, **extra)
        self.past_len = input_ids.shape[1]
        logits_rows = out.logits[0]
        if picked is not None and logits_rows.shape[0] != len(picked):  # a forward without logits_to_keep
            logits_rows = logits_rows[torch.from_numpy(picked).to(logits_rows.device)]
        ids, logits, argmax = acceptance.top_rows(logits_rows, target.top_k)
        if wanted == "none":  # the last row is all this prefill's caller reads
            ids, logits = no_prompt_rows(target.top_k)
        else:
            ids, logits = spread_rows(self.past_len, picked, ids, logits)
        first = int(argmax[-1]) if sampler is None else sampler.token(logits_rows[-1], 0)
        return target.report_prompt(inputs.input_ids[0].numpy(), ids, logits,
                                  capture.take() if capture is not None else None), first

    @torch.inference_mode()
    def verify(self, root: int, tree: DraftTree, sampler: Sampler | None, position: int) -> VerifiedTree:
        """One forward over [root] + the tree's nodes, each seeing the prefix and its ancestors."""
        target = self.target
        tokens, depths = tree.packed(root)
        capture = self._arm_capture(0)
        window = target.layer_window
        if window:
            mask = tree_attention_masks(tree.ancestor_matrix(), depths, self.past_len, window, target.dtype,
                                        target.device)
        else:
            mask = tree_attention_mask(tree.ancestor_matrix(), self.past_len, target.dtype, target.device)
        out = target.model(
            input_ids=torch.from_numpy(tokens).to(target.device)[None],
            position_ids=tree_positions(depths, self.past_len, self.position_offset, target.device),
            attention_mask=mask,
            cache=self.cache,
            use_cache=True,
        )
        self._packed = len(tokens)
        return acceptance.verified(tree, out.logits[0], target.top_k, sampler, position,
                                   capture.take() if capture is not None else None)

    @torch.inference_mode()
    def commit(self, keep: Sequence[int]) -> None:
        """Keep these packed rows' KV entries (the root's and the accepted nodes'), drop the rest."""
        compact_cache(self.cache, self.past_len, keep, self._packed)
        self.past_len += len(keep)
        self._packed = 0

    def truncate(self, length: int) -> None:
        """Forget committed positions past ``length``."""
        count = self.past_len - length
        if count > 0:
            self.cache.crop(-count)
            self.past_len = length

    def release(self) -> None:
        self.cache = None
        self.image_positions = None


def refuse_unreadable(target: TargetModel, kernels: str, weights: str) -> None:
    """Refuse a choice of kernels and weights the model cannot run: one built from its GGUF
    file's blocks without float weights has nothing for the stock path (or a float decoder)
    to read; ``stored`` weights need the fast kernels and a GGUF file."""
    if target.float_copy is False and (kernels == "stock" or target.gguf_file is None or weights == "float"):
        raise InputError(f"{target.name} was built from its GGUF file's blocks without float weights "
                         "(float_copy=False): it runs on the fast kernels reading that file; load it with "
                         "float_copy=True for the stock path or weights='float'")
    if weights == "stored" and (kernels == "stock" or target.gguf_file is None):
        raise InputError("--weights stored needs the fast kernels and a model loaded from a GGUF file "
                         f"({target.name} was not)" if target.gguf_file is None else
                         "--weights stored needs the fast kernels (the stock path reads float weights)")


@torch.inference_mode()
def stock_generate(target: TargetModel, inputs: ModelInputs, max_new_tokens: int,
                   eos_token_ids: Sequence[int] | None = None) -> list[int]:
    """Plain greedy ``model.generate(do_sample=False)`` on stock transformers, with a clean
    greedy config: sampling-oriented defaults a checkpoint may carry (repetition penalty,
    top-k...) do not apply, since RECAP reproduces argmax decoding."""
    eos = list(target.eos_token_ids if eos_token_ids is None else eos_token_ids)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos or None,
                              pad_token_id=(eos[0] if eos else 0))
    input_ids = inputs.input_ids.to(target.device)
    out = target.model.generate(input_ids=input_ids, generation_config=config, **inputs.on(target.device))
    return out[0, input_ids.shape[1]:].tolist()

