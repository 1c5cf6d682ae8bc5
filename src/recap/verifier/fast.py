"""Requests on the project's own kernels (`recap.verifier.kernels`): a `FastRunner` holds
what every request on one model shares (the compiled decoder, on the GGUF file's blocks or
the float weights; the float copies it dropped; the prefix cache), a `FastLane` one
request's state (its KV cache and positions). A lane's step is a part of a
`recap.verifier.batch.StepBatch`, so one request and a batch share every kernel call."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from recap.core import DraftTree, PromptRows, RowsWanted, VerifiedTree
from recap.errors import InputError
from recap.verifier import acceptance
from recap.verifier.batch import StepBatch, StepRequest, verify_batch
from recap.verifier.inputs import ModelInputs
from recap.verifier.kernels import FastDecoder, prefix
from recap.verifier.kernels.args import language_model
from recap.verifier.kernels.prefix import ChunkedPrefill, PrefixCache
from recap.verifier.kernels.stored import FloatCopies, StoredWeights, WeightsMismatch
from recap.verifier.sampling import Sampler
from recap.verifier.stock import StockLane

if TYPE_CHECKING:
    from recap.verifier.base import TargetModel


class FastRunner:
    """One model on the fast kernels, shared by all its lanes (`TargetModel.fork`)."""

    def __init__(self, target: TargetModel, weights: str):
        # no reference to the model itself: `recap.hf` lets a caller's dropped model go
        self.float_copies: FloatCopies | None = None
        """The float weights the decoder reads as GGUF blocks: dropped while it runs, rebuilt
        for anything else (the stock path, a float decoder)."""
        self.decoder = self._build(target, weights)
        self._decoders: dict[str, FastDecoder] = {self.decoder.weights: self.decoder}
        self.prefix_cache = PrefixCache()
        """Recent prompts' KV rows, shared by every lane (`recap.verifier.kernels.prefix`)."""

    def _build(self, target: TargetModel, weights: str) -> FastDecoder:
        """The decoder on the GGUF file's blocks where ``weights`` asks for them (``auto``: where
        the file is known and its blocks match the model; a mismatch falls back to the float
        weights with a warning), on the model's float weights otherwise."""
        model = target.model
        if weights == "float" or target.gguf_file is None:
            return FastDecoder(model)
        try:
            decoder = FastDecoder(model, stored=StoredWeights.open(target.gguf_file))
        except WeightsMismatch as error:
            if weights == "stored":
                raise
            warnings.warn(f"reading float weights: {error}", stacklevel=4)
            return FastDecoder(model)
        embedding = language_model(model).embed_tokens.weight
        # an image prompt's embedding runs the model's own module: a VLM keeps its float table
        pairs = [(parameter, blocks) for parameter, blocks in decoder.stored_pairs
                 if not (target.accepts_images and parameter is embedding)]
        self.float_copies = FloatCopies(model, pairs) if pairs else None
        return decoder

    @property
    def weights(self) -> str:
        return self.decoder.weights

    def float_weights(self, needed: bool) -> None:
        """Rebuild the dropped float weights when something else reads them, drop them again
        when only the decoder runs."""
        if self.float_copies is not None:
            self.float_copies.restore() if needed else self.float_copies.drop()

    def lane(self, target: TargetModel) -> FastLane:
        """A new request lane for ``target`` (the model's adapter or one of its forks)."""
        return FastLane(target, self)

    def use_weights(self, target: TargetModel, weights: str) -> str:
        """Switch what the decoder reads (``stored`` or ``float``) between requests. Each
        decoder is built once and kept; once a float one exists the float copies stay (it
        reads them in place)."""
        if weights not in self._decoders:
            if weights == "stored":
                raise InputError(f"{target.name} has no GGUF blocks to read (weights: {self.weights})")
            if self.float_copies is not None:
                self.float_copies.restore()
                self.float_copies = None
            self._decoders[weights] = FastDecoder(target.model)
        self.decoder = self._decoders[weights]
        return self.weights


class FastLane:
    """One request's state on the fast kernels; only its own methods write it."""

    def __init__(self, target: TargetModel, runner: FastRunner):
        self.target, self.runner = target, runner
        self.kv: Any = None
        """The request's `KVCache`."""
        self.past_len = 0
        self.position_offset = 0
        self.image_positions: np.ndarray | None = None
        """The prompt's image placeholder positions (an image prompt of a model that has them)."""
        self.last_logits: np.ndarray | None = None
        """The logits (N, V) of the last verify (a reused buffer), for tests."""

    @property
    def decoder(self) -> FastDecoder:
        return self.runner.decoder

    @property
    def holds_cache(self) -> bool:
        return self.kv is not None

    # ----------------------------------------------------------------- prefill
    def start_prompt(self, length: int, rope_offset: int, image_positions: np.ndarray | None) -> None:
        """An empty cache for a prompt of ``length`` tokens (`ChunkedPrefill`)."""
        self.kv = self.decoder.new_cache(length + 256)
        self.past_len, self.position_offset, self.image_positions = 0, rope_offset, image_positions

    def load_prefix(self, keys: np.ndarray, values: np.ndarray, count: int) -> None:
        """Take ``count`` rows of K/V computed for an earlier prompt (`PrefixCache`)."""
        self.kv.load(keys, values, count)
        self.past_len = self.kv.length

    def keep_chunk(self, count: int) -> None:
        """Keep the K/V of the prefill chunk just run (its ``count`` rows)."""
        self.kv.commit(range(count))
        self.past_len = self.kv.length

    def run_chunk(self, chunked: ChunkedPrefill, budget: int) -> None:
        """One prefill chunk in a forward of its own."""
        rows = chunked.rows(budget)
        vectors = chunked.embeds()
        chunked.absorb(self.decoder.forward(self.kv, *rows, [] if vectors is None else [(0, vectors)],
                                            chunked.logit_rows()))

    @torch.inference_mode()
    def prefill(self, inputs: ModelInputs, wanted: RowsWanted, sampler: Sampler | None) -> tuple[PromptRows, int]:
        """Prefill in chunks (`ChunkedPrefill`: the same chunks a batch interleaves with other
        requests' steps); a prompt they cannot take (caller-made positions, a padded mask) runs
        transformers' forward and its K/V are copied into the kernels' cache."""
        chunked = self.chunks(inputs, wanted)
        if chunked is not None:
            while not chunked.finished:
                self.run_chunk(chunked, prefix.PREFILL_CHUNK)
            return chunked.result(sampler)
        stock = StockLane(self.target)
        rows, first = stock.prefill(inputs, wanted, sampler)
        self.kv = self.decoder.new_cache(stock.past_len + 256)
        self.kv.load([layer.keys[0].float().numpy() for layer in stock.cache.layers],
                     [layer.values[0].float().numpy() for layer in stock.cache.layers], stock.past_len)
        self.past_len, self.position_offset = stock.past_len, stock.position_offset
        self.image_positions = None if stock.image_positions is None else stock.image_positions.cpu().numpy()
        return rows, first

    def chunks(self, inputs: ModelInputs, wanted: RowsWanted) -> ChunkedPrefill | None:
        """The prompt's prefill as chunks (`ChunkedPrefill`): a text prompt, or an image prompt
        after `recap.verifier.inputs.encode_images` (run here if the caller has not). None
        where transformers' forward runs it whole: caller-made positions, a padded mask, or
        an image whose rows attend to each other both ways (`causal_images`)."""
        if inputs.positions is not None or inputs.padded:
            return None
        if inputs.has_image and not self.target.causal_images:
            return None
        if inputs.has_image:
            return ChunkedPrefill(self, inputs.input_ids[0].numpy(), wanted, self.target.encode_images(inputs).language)
        if not set(inputs.extra) <= {"attention_mask", "mm_token_type_ids", "token_type_ids"}:  # all text rows
            return None
        return ChunkedPrefill(self, inputs.input_ids[0].numpy(), wanted)

    # ----------------------------------------------------------------- decode steps
    def verify(self, root: int, tree: DraftTree, sampler: Sampler | None, position: int) -> VerifiedTree:
        """A batch of one (`recap.verifier.batch.verify_batch`)."""
        return verify_batch(StepBatch([StepRequest(self.target, root, tree, sampler, position)]))[0]

    def step_rows(self, root: int, tree: DraftTree) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """This lane's part of a step: packed tokens, RoPE positions, and the CSR ancestor lists
        (`DraftTree.ancestor_lists`, indices local to the lane)."""
        tokens, depths = tree.packed(root)
        starts, paths = tree.ancestor_lists()
        return tokens, depths + (self.past_len + self.position_offset), starts, paths

    def verified(self, tree: DraftTree, logits: np.ndarray, row: int, sampler: Sampler | None,
                 position: int) -> VerifiedTree:
        """The verification from this lane's logits rows (N, V) of a step whose packed ``row`` is
        its root; with SAM+ViSkip's capture on, the root's attention mass on the image (the
        stock capture's definition)."""
        self.last_logits = logits
        capture = self.target.capture
        image_attention = None
        if capture is not None and capture.enabled and self.image_positions is not None \
                and len(self.image_positions):
            image_attention = self.decoder.root_image_attention(self.kv, self.image_positions, row)
        return acceptance.verified(tree, torch.from_numpy(logits), self.target.top_k, sampler, position,
                                   image_attention)

    def commit(self, keep: Sequence[int]) -> None:
        """Keep these packed rows' KV entries (the root's and the accepted nodes'), drop the rest."""
        self.kv.commit(keep)
        self.past_len = self.kv.length

    def truncate(self, length: int) -> None:
        """Forget committed positions past ``length``."""
        count = self.past_len - length
        if count > 0:
            self.kv.length -= count
            self.past_len = length

    def release(self) -> None:
        self.kv = None
        self.image_positions = None
