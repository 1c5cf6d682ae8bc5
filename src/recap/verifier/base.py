"""`TargetModel`: one interface over unmodified Hugging Face models.

prefill(inputs) -> Top-K rows at every prompt position and the first greedy token;
verify(root, tree) -> one packed forward, Top-K row and argmax at every node;
commit(accepted) -> KV compaction. Family adapters (plain LMs, Qwen-VL, LLaVA) only say how
to turn a prompt and an image into model inputs and how positions are offset.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import os
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import DynamicCache, GenerationConfig

from recap.core import (
    NOT_COMPUTED,
    ROWS_WANTED,
    CostProfile,
    DraftTree,
    PromptRows,
    RowsWanted,
    VerifiedTree,
    first_eligible,
)
from recap.errors import InputError
from recap.verifier import acceptance
from recap.verifier.attention import compact_cache, tree_attention_mask, tree_positions
from recap.verifier.image_attention import ImageAttentionCapture
from recap.verifier.kernels.args import language_model
from recap.verifier.kernels.prefix import PREFILL_CHUNK, ChunkedPrefill
from recap.verifier.kernels.stored import without_float_copy
from recap.verifier.protocol import BaseTarget
from recap.verifier.sampling import Sampler

WEIGHTS = ("auto", "stored", "float")
"""What the fast kernels read (`TargetModel.weights`): ``stored`` GGUF blocks, ``float`` the
model's tensors, ``auto`` stored where the model came from a GGUF file whose blocks match."""

Message = dict[str, Any]


ANSWER_PROBE = "alpha beta gamma"
"""The assistant turn of the probe conversation `TargetModel.answer_header` checks itself on."""


def _after_headers(prompt: np.ndarray, header: tuple[int, ...], special: set[int]) -> np.ndarray:
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
    """The prompt as the language model takes it, once `TargetModel.encode_images` has run
    the vision tower (the fast kernels then prefill an image prompt in chunks)."""

    @property
    def prompt_ids(self) -> list[int]:
        return self.input_ids[0].tolist()


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


def first_argmax(logits: torch.Tensor, values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1, keepdim=True)`` (the first index of each row's maximum) read off
    the row's Top-K (``values``, ``ids`` from `torch.topk`) instead of a second pass over the
    vocabulary (0.8 ms for 8 rows of 49,152 on one core). Exact: when fewer than K entries
    tie at the maximum, all of them are in the Top-K, and the first is the smallest id among
    them; a row whose K values all tie, or that holds a NaN, is recomputed with ``argmax``."""
    at_max = values == values[:, :1]
    first = torch.where(at_max, ids, torch.full_like(ids, logits.shape[-1])).min(dim=-1, keepdim=True).values
    unsure = at_max[:, -1] | torch.isnan(values[:, 0])
    if bool(unsure.any()):
        first[unsure] = logits[unsure].argmax(dim=-1, keepdim=True)
    return first


class TargetModel(BaseTarget):
    """Base adapter: a decoder-only causal LM, a `recap.verifier.protocol.Target` with every
    optional ability (context limit, sliding window, image-attention capture, cost profile,
    sampling). Subclasses override the hooks marked below."""

    family = "causal-lm"
    accepts_images = False
    can_sample = True

    def __init__(self, model: torch.nn.Module, processor: Any, *, top_k: int = 8, kernels: str = "auto",
                 weights: str = "auto", gguf_file: str | os.PathLike | None = None):
        self.model = model.eval()
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.top_k = top_k
        self.text_config = model.config.get_text_config(decoder=True)
        self.vocab_size = int(self.text_config.vocab_size)
        self.max_context = int(getattr(self.text_config, "max_position_embeddings", 0) or 1 << 30)
        self.sliding_window = _sliding_window(self.text_config)
        self.excluded_tokens = frozenset(self._image_token_ids())
        self._reset_request()
        self._capture: ImageAttentionCapture | None = None
        self._image_token = getattr(model.config, "image_token_id", None) if self.accepts_images else None
        self._encode_lock = threading.Lock()
        self.cost_profile: CostProfile | None = None
        """Verify-cost profile handed to cost-aware proposers; None: resolved on first use."""
        self._cost_key: dict | None = None
        self.kernels = "stock"
        """``fast``: decode and verify steps on the project's own kernels (`recap.verifier.kernels`);
        ``stock``: transformers' forward. Set by `use_kernels`."""
        self._fast: Any = None
        self._float_copies: Any = None
        """The float weights the fast kernels read as GGUF blocks (`FloatCopies`): dropped
        while they run, rebuilt for anything else."""
        self._decoders: dict[str, Any] = {}
        """Fast decoders by the weights they read, once `use_weights` switched between them."""
        self.float_copy = not without_float_copy(model)
        """False for a model built from a GGUF file without its float weights (`recap.load`'s
        ``float_copy``): the fast kernels read the file; the floats exist only once rebuilt."""
        self.parameter_count = sum(parameter.numel() for parameter in model.parameters())
        """The model's parameters, counted at load (some may be dropped later: `FloatCopies`)."""
        if weights not in WEIGHTS:
            raise InputError(f"unknown weights {weights!r}; choose one of: {', '.join(WEIGHTS)}")
        self._weights_wanted = weights
        self.gguf_file = None if gguf_file is None else Path(gguf_file)
        """The GGUF file the model was de-quantised from (None: not known): the fast kernels
        read its blocks as stored where `weights` allows."""
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        """Whether the model's forward takes ``logits_to_keep`` (transformers' causal LMs and VLMs do)."""
        self.use_kernels(kernels)

    def _reset_request(self) -> None:
        """The per-request state: a lane (`fork`) starts with its own."""
        self.cache: DynamicCache | None = None
        self._kv: Any = None
        self.past_len = 0
        self.position_offset = 0
        self._packed = 0
        self._image_positions: torch.Tensor | None = None
        self.last_logits: np.ndarray | None = None
        """The fast path's logits (N, V) of the last verify (a reused buffer), for tests."""
        self.prefix_scope = ""
        """Whose cached prompt prefixes this request may reuse (`PrefixCache`; the server: its tenant)."""
        self._prompt_rows: RowsWanted = "all"
        """Which prompt rows' Top-K the next prefill computes (`keep_prompt_rows`)."""

    @property
    def batches(self) -> bool:
        """On the fast kernels, lanes share one forward per step; stock verifies them in turn."""
        return self.kernels == "fast"

    def shares_forward_with(self, other: object) -> bool:
        """Whether ``other`` can ride in this lane's forward (`recap.verifier.batch`): both hold
        a request on the same model's fast kernels."""
        return isinstance(other, TargetModel) and self._kv is not None and other._kv is not None \
            and other._fast is self._fast

    def fork(self) -> TargetModel:
        """Another request lane on the same model: it shares the weights, the fast kernels,
        the tokenizer and the cost profile, and has its own KV state. Batched decoding
        (`recap.batching`) runs each request on its own lane, so several requests can be
        between prefill and release at once; `recap.verifier.batch.verify_batch` verifies their
        trees in one forward."""
        lane = copy.copy(self)
        lane._reset_request()
        return lane

    # ----------------------------------------------------------------- family hooks
    def _image_token_ids(self) -> list[int]:
        """Placeholder tokens the vision encoder fills in; never drafted, never seeded."""
        return []

    def _build_inputs(self, messages: list[Message], image: Image.Image | None) -> ModelInputs:
        if image is not None:
            raise InputError(f"{self.name} is a text-only model: it cannot take an image")
        text = _flatten_text(messages)
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True, return_tensors="pt")["input_ids"]
        else:
            ids = self.tokenizer(text, return_tensors="pt")["input_ids"]
        return ModelInputs(input_ids=ids)

    def _prompt_positions(self, inputs: ModelInputs) -> tuple[torch.Tensor, int]:
        """Position ids for the prompt, and the offset later steps add to the cached length."""
        return torch.arange(inputs.input_ids.shape[1], device=self.device)[None], 0

    def _prefill_positions(self, inputs: ModelInputs) -> torch.Tensor:
        """Position ids for the prompt; sets ``self.position_offset`` for later steps."""
        positions, self.position_offset = self._prompt_positions(inputs)
        return positions

    # ----------------------------------------------------------------- public interface
    def use_kernels(self, kernels: str = "auto") -> str:
        """Choose the step path between requests: ``auto`` (``fast`` on CPU where the
        architecture is supported, else ``stock``), ``fast`` (an error where unsupported) or
        ``stock``. Returns the path now in use. The fast path reads the model's own weights
        and is compiled and warmed here, once per target."""
        from recap.verifier.kernels import KERNELS, FastDecoder, unsupported

        if kernels not in KERNELS:
            raise InputError(f"unknown kernels {kernels!r}; choose one of: {', '.join(KERNELS)}")
        if kernels != "stock":
            reason = unsupported(self.model)
            if reason is not None and kernels == "fast":
                raise InputError(f"--kernels fast does not support {self.name}: {reason}")
            kernels = "stock" if reason is not None else "fast"
        if self._fast is None and self.float_copy is False and (kernels == "stock" or self.gguf_file is None
                                                               or self._weights_wanted == "float"):
            raise InputError(f"{self.name} was built from its GGUF file's blocks without float weights "
                             "(float_copy=False): it runs on the fast kernels reading that file; load it with "
                             "float_copy=True for the stock path or weights='float'")
        if self._weights_wanted == "stored" and self._fast is None and (kernels == "stock" or self.gguf_file is None):
            raise InputError("--weights stored needs the fast kernels and a model loaded from a GGUF file "
                             f"({self.name} was not)" if self.gguf_file is None else
                             "--weights stored needs the fast kernels (the stock path reads float weights)")
        if kernels == "fast" and self._fast is None:
            from recap.verifier.kernels.prefix import PrefixCache

            self._fast = self._fast_decoder(FastDecoder)
            self.prefix_cache = PrefixCache()
            """Recent prompts' KV rows, shared by every lane (`recap.verifier.kernels.prefix`)."""
        if self._float_copies is not None and kernels == "stock":  # the stock path reads the floats
            self._float_copies.restore()
        elif self._float_copies is not None:  # the fast one reads the blocks
            self._float_copies.drop()
        self.kernels = kernels  # an automatic cost profile follows: the kernels are part of its key
        return self.kernels

    def _fast_decoder(self, decoder: type) -> Any:
        """The fast decoder, on the GGUF file's blocks where `weights` asks for them (``auto``:
        where the file is known and its blocks match the model; a mismatch falls back to the
        float weights with a warning) and on the model's float weights otherwise."""
        from recap.verifier.kernels.stored import FloatCopies, StoredWeights, WeightsMismatch

        if self._weights_wanted == "float" or self.gguf_file is None:
            return decoder(self.model)
        try:
            fast = decoder(self.model, stored=StoredWeights.open(self.gguf_file))
        except WeightsMismatch as error:
            if self._weights_wanted == "stored":
                raise
            warnings.warn(f"reading float weights: {error}", stacklevel=3)
            return decoder(self.model)
        keep_embedding = self.accepts_images  # an image prompt's embedding runs the model's own module
        embedding = language_model(self.model).embed_tokens.weight
        pairs = [(parameter, blocks) for parameter, blocks in fast.stored_pairs
                 if not (keep_embedding and parameter is embedding)]
        self._float_copies = FloatCopies(self.model, pairs) if pairs else None
        return fast

    def use_weights(self, weights: str) -> str:
        """Switch what the fast steps read between requests, for comparisons (`recap bench
        --reference float`): ``stored`` or ``float``. Each decoder is built once and kept;
        once a float one exists the float copies stay (it reads them in place). Returns the
        weights now read."""
        from recap.verifier.kernels import FastDecoder

        if weights not in ("stored", "float"):
            raise InputError(f"use_weights takes stored or float, got {weights!r}")
        if self.kernels != "fast" or weights == self.weights:
            return self.weights
        self._decoders.setdefault(self._fast.weights, self._fast)
        if weights not in self._decoders:
            if weights == "stored":
                raise InputError(f"{self.name} has no GGUF blocks to read (weights: {self._fast.weights})")
            if self._float_copies is not None:
                self._float_copies.restore()
                self._float_copies = None
            self._decoders[weights] = FastDecoder(self.model)
        self._fast = self._decoders[weights]
        return self.weights

    @property
    def weights(self) -> str:
        """What the decode steps read: ``stored`` (GGUF blocks, de-quantised in registers to
        the float weights, bit for bit) or ``float`` (the model's own tensors)."""
        return self._fast.weights if self.kernels == "fast" else "float"

    @property
    def name(self) -> str:
        return getattr(self.model, "name_or_path", "") or type(self.model).__name__

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def cost_row_block(self) -> int:
        """How a step's cost grows with its packed rows, for the cost profile: 1 (row by row)
        on stock kernels, the fast decoder's `FastDecoder.row_block` on the fast ones."""
        return self._fast.row_block if self.kernels == "fast" else 1

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

    def prompt_length(self, inputs: ModelInputs) -> int:
        return int(inputs.input_ids.shape[1])

    def keep_prompt_rows(self, rows: RowsWanted = "all") -> RowsWanted:
        """Which prompt rows' Top-K the next prefill computes: ``all`` by default, and again
        after each prefill (the choice is one request's). ``first`` (RECAP-paper, tree
        recycling: they seed token-keyed memories from each eligible token's first row),
        ``answers`` (RECAP: those first rows inside earlier assistant turns) and ``none``
        (AR, PLD, SAM, lookahead, token recycling) run the LM head on those rows and the last
        one alone, as `model.generate` does for the last (``logits_to_keep``): the head is
        about a fifth of a prompt row's arithmetic on SmolLM2 (more with a larger vocabulary),
        an image's placeholder rows are never read, and a method should not pay for what only
        another method uses. Rows not computed are `recap.core.NOT_COMPUTED` (``none``: empty
        arrays). Returns the choice."""
        if rows not in ROWS_WANTED:
            raise ValueError(f"prompt rows must be one of {', '.join(ROWS_WANTED)}, got {rows!r}")
        self._prompt_rows = rows
        return rows

    def wanted_rows(self, prompt: np.ndarray, rows: RowsWanted) -> np.ndarray | None:
        """The positions (ascending) whose logits a prefill computes for ``rows``: None for
        ``all``; the last row always."""
        if rows == "all":
            return None
        last = np.array([len(prompt) - 1], np.int64)
        if rows == "none":
            return last
        firsts = first_eligible(prompt, self.eligible(prompt))
        if rows == "answers":
            firsts = firsts[self.answer_mask(prompt)[firsts]]
        return np.union1d(firsts, last).astype(np.int64)

    def answer_mask(self, prompt: np.ndarray) -> np.ndarray:
        """(P,) bool: the prompt positions inside earlier assistant turns (their content, up to
        the turn's closing special token), found from the chat template's assistant header
        (`answer_header`); all False where the header is not known."""
        return _after_headers(np.asarray(prompt).reshape(-1), self.answer_header, self._special_ids())

    @functools.cached_property
    def answer_header(self) -> tuple[int, ...]:
        """The tokens that open an assistant turn in this model's chat prompts: what the chat
        template adds after a user turn, from its last special token on (ChatML's
        ``<|im_start|>assistant\n``). Checked on a probe conversation whose assistant turn
        `answer_mask` must find exactly; empty where the template has no such header or the
        probe fails (then nothing counts as an earlier answer)."""
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": ANSWER_PROBE},
                 {"role": "user", "content": "y"}]
        try:
            opened = self._build_inputs(probe[:1], None).input_ids[0].tolist()
            whole = self._build_inputs(probe, None).input_ids[0].tolist()
        except Exception:  # noqa: BLE001 - a template that cannot render the probe has no known header
            return ()
        special = self._special_ids()
        marks = [i for i, token in enumerate(opened) if token in special]
        if not marks or whole[:len(opened)] != opened:
            return ()
        header = tuple(opened[marks[-1]:])
        whole = np.asarray(whole)
        found = whole[_after_headers(whole, header, special)]
        return header if self.tokenizer.decode(found.tolist()).strip() == ANSWER_PROBE else ()

    def _special_ids(self) -> set[int]:
        return set(getattr(self.tokenizer, "all_special_ids", []) or [])

    def spread_rows(self, length: int, positions: np.ndarray | None, topk_ids: np.ndarray,
                    topk_logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(length, K) Top-K arrays holding the rows computed at ``positions`` (None: all of
        them, as they are), every other row `recap.core.NOT_COMPUTED`."""
        if positions is None:
            return topk_ids, topk_logits
        ids = np.full((length, topk_ids.shape[1]), NOT_COMPUTED, np.int64)
        logits = np.full((length, topk_ids.shape[1]), -np.inf, np.float32)
        ids[positions], logits[positions] = topk_ids, topk_logits
        return ids, logits

    def no_prompt_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The (0, K) Top-K arrays of a prefill that kept no prompt rows."""
        return np.zeros((0, self.top_k), np.int64), np.zeros((0, self.top_k), np.float32)

    def capture_image_attention(self, enabled: bool = True) -> bool:
        """Turn on (or off) the measurement of the final-layer, head-averaged attention mass
        on the prompt's image tokens (`recap.verifier.image_attention`). While on, prefill and
        verify report it as ``image_attention`` (None for prompts without an image). Returns
        whether it is on: a text-only model or an unsupported attention kernel cannot capture.
        Off, the model runs its stock attention code."""
        if not enabled or self._image_token is None:
            if self._capture is not None:
                self._capture.disable()
            return False
        if self._capture is None:
            self._capture = ImageAttentionCapture.for_model(self.model)
        return self._capture is not None and self._capture.enable()

    def _arm_capture(self, query_row: int, input_ids: torch.Tensor | None = None) -> ImageAttentionCapture | None:
        """Ask the capture for one query row of the next forward; prefill also gives the prompt
        ids, whose image positions are kept for the request."""
        capture = self._capture
        if capture is None or not capture.enabled:
            return None
        if input_ids is not None:
            self._image_positions = (input_ids[0] == self._image_token).nonzero().flatten()
        capture.arm(self._image_positions, query_row)
        return capture

    def prepare(self, prompt: str | list[Message], image: Image.Image | None = None) -> ModelInputs:
        """Turn a prompt (text, or chat messages) and an optional image into model inputs."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if not messages or not _flatten_text(messages).strip():
            raise InputError("the prompt is empty")
        inputs = self._build_inputs(messages, image)
        length = inputs.input_ids.shape[1]
        if length >= self.max_context:
            raise InputError(f"the prompt is {length} tokens long; {self.name} takes at most "
                             f"{self.max_context - 1} before generating")
        return inputs

    @torch.inference_mode()
    def prefill(self, inputs: ModelInputs, sampler: Sampler | None = None) -> tuple[PromptRows, int]:
        """Run the prompt, keep its KV cache; return the Top-K rows at every prompt position
        and the first token, greedy or drawn by ``sampler`` (its KV entry is not cached yet:
        it is the next root). Text prompts on the fast kernels run as a `ChunkedPrefill`
        (the same chunks a batch interleaves with other requests' steps)."""
        chunked = self.prefill_chunks(inputs)
        if chunked is not None:
            while not chunked.finished:
                rows = chunked.rows(PREFILL_CHUNK)
                vectors = chunked.embeds()
                chunked.absorb(self._fast.forward(self._kv, *rows, [] if vectors is None else [(0, vectors)],
                                                  chunked.logit_rows()))
            return chunked.result(sampler)
        self._packed = 0
        self.cache = DynamicCache()
        input_ids = inputs.input_ids.to(self.device)
        extra = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.extra.items()}
        positions = self._prefill_positions(inputs)
        capture = self._arm_capture(-1, input_ids)
        wanted, self._prompt_rows = self._prompt_rows, "all"  # this prefill spends the request's choice
        picked = self.wanted_rows(input_ids[0].cpu().numpy(), wanted)
        if picked is not None and self._keeps_logits:
            extra["logits_to_keep"] = 1 if len(picked) == 1 else torch.from_numpy(picked).to(self.device)
        out = self.model(input_ids=input_ids, position_ids=positions, cache=self.cache, use_cache=True, **extra)
        self.past_len = input_ids.shape[1]
        if self.kernels == "fast":
            self._kv = self._fast.new_cache(self.past_len + 256)
            self._kv.load([layer.keys[0].float().numpy() for layer in self.cache.layers],
                          [layer.values[0].float().numpy() for layer in self.cache.layers], self.past_len)
            self.cache = None
        logits_rows = out.logits[0]
        if picked is not None and logits_rows.shape[0] != len(picked):  # a forward without logits_to_keep
            logits_rows = logits_rows[torch.from_numpy(picked).to(logits_rows.device)]
        ids, logits, argmax = self._top_rows(logits_rows)
        if wanted == "none":  # the last row is all this prefill's caller reads
            ids, logits = self.no_prompt_rows()
        else:
            ids, logits = self.spread_rows(self.past_len, picked, ids, logits)
        first = int(argmax[-1]) if sampler is None else sampler.token(logits_rows[-1], 0)
        return self.prompt_rows(inputs.input_ids[0].numpy(), ids, logits,
                                capture.take() if capture is not None else None), first

    def prompt_rows(self, prompt: np.ndarray, topk_ids: np.ndarray, topk_logits: np.ndarray,
                    image_attention: float | None = None) -> PromptRows:
        """What prefill reports to a proposer: the prompt's Top-K rows, and which positions may
        seed token-keyed memories (not image placeholders, not special tokens)."""
        return PromptRows(ids=prompt, topk_ids=topk_ids, topk_logits=topk_logits, eligible=self.eligible(prompt),
                          vocab_size=self.vocab_size, excluded_tokens=self.excluded_tokens,
                          image_attention=image_attention)

    def eligible(self, prompt: np.ndarray) -> np.ndarray:
        """Which prompt positions may seed token-keyed memories: not image placeholders, not
        special tokens."""
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        return np.array([t not in self.excluded_tokens and t not in special for t in prompt.tolist()], dtype=bool)

    def prefill_chunks(self, inputs: ModelInputs) -> ChunkedPrefill | None:
        """The prompt's prefill as chunks the caller runs (`ChunkedPrefill`) on the fast
        kernels: a text prompt, or an image prompt after `encode_images` (run here if the
        caller has not). None where ``prefill`` runs transformers' forward whole: the stock
        kernels, caller-made positions or a padded mask."""
        if self.kernels != "fast" or inputs.positions is not None:
            return None
        mask = inputs.extra.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            return None
        if inputs.has_image:
            language = self.encode_images(inputs).language
            return ChunkedPrefill(self, inputs.input_ids[0].numpy(), language)
        if not set(inputs.extra) <= {"attention_mask", "mm_token_type_ids"}:
            return None
        return ChunkedPrefill(self, inputs.input_ids[0].numpy())

    @torch.inference_mode()
    def encode_images(self, inputs: ModelInputs) -> ModelInputs:
        """Run the vision tower of an image prompt now, in the caller's thread, and keep what
        the language model would receive (`LanguageInputs`): the server calls this while it
        prepares a request, so the decoding thread only prefills the language rows, in chunks
        beside the running requests. The embeddings are taken from the model's own forward,
        stopped at its language model's input, so every family merges its image features
        as transformers does. Text prompts, the stock kernels and prepared inputs pass through.
        One encode at a time per model: the others wait rather than take the decoder's core."""
        if inputs.language is not None or not inputs.has_image or self.kernels != "fast" \
                or inputs.positions is not None:
            return inputs
        decoder = language_model(self.model)
        positions, offset = self._prompt_positions(inputs)
        seen: dict[str, torch.Tensor] = {}
        caller = threading.get_ident()

        def take(module, args, kwargs):  # another thread's forward on this model passes through
            if threading.get_ident() != caller:
                return None
            seen.update(embeds=kwargs.get("inputs_embeds"), positions=kwargs.get("position_ids"))
            raise _Captured

        extra = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.extra.items()}
        with self._encode_lock:
            handle = decoder.register_forward_pre_hook(take, with_kwargs=True)
            try:
                self.model(input_ids=inputs.input_ids.to(self.device), position_ids=positions, use_cache=False,
                           **extra)
            except _Captured:
                pass
            finally:
                handle.remove()
        if seen.get("embeds") is None:
            raise RuntimeError(f"{self.name}: the language model's input embeddings could not be taken")
        taken = seen["positions"] if seen.get("positions") is not None else positions
        taken = taken.reshape(-1, taken.shape[-1])[-3:] if taken.ndim == 3 else taken.reshape(1, -1)
        rows = taken[0] if taken.shape[0] == 1 else taken.T  # (P,) or (P, 3)
        image_rows = np.flatnonzero(np.isin(inputs.input_ids[0].numpy(), list(self.excluded_tokens)))
        language = LanguageInputs(
            embeds=np.ascontiguousarray(seen["embeds"][0].float().numpy()),
            positions=np.ascontiguousarray(rows.cpu().numpy().astype(np.int64)), rope_offset=int(offset),
            first_image_row=int(image_rows[0]) if len(image_rows) else inputs.input_ids.shape[1])
        mask = inputs.extra.get("attention_mask")
        if mask is not None and not bool(mask.all()):  # `prefill` runs transformers' forward: it needs the pixels
            return dataclasses.replace(inputs, language=language)
        # the pixels have become the language rows: a queued request (a server's) need not keep them
        kept = {name: value for name, value in inputs.extra.items() if not name.startswith("pixel_values")}
        return dataclasses.replace(inputs, language=language, extra=kept)

    @torch.inference_mode()
    def verify(self, root: int, tree: DraftTree, sampler: Sampler | None = None, position: int = 0) -> VerifiedTree:
        """One forward over [root] + tree nodes, each seeing the prefix and its ancestors.
        Greedy by default; with ``sampler``, the sampling walk decides (``position``: the
        output position the root's row predicts). On the fast path this is a batch of one
        (`recap.verifier.batch.verify_batch`), so one request and a batch share every kernel call."""
        if self.cache is None and self._kv is None:
            raise RuntimeError("verify() before prefill()")
        if self._kv is not None:
            from recap.verifier.batch import verify_batch

            return verify_batch([self], [root], [tree], [sampler], [position])[0]
        tokens, depths = tree.packed(root)
        capture = self._arm_capture(0)
        out = self.model(
            input_ids=torch.from_numpy(tokens).to(self.device)[None],
            position_ids=tree_positions(depths, self.past_len, self.position_offset, self.device),
            attention_mask=tree_attention_mask(tree.ancestor_matrix(), self.past_len, self.dtype, self.device),
            cache=self.cache,
            use_cache=True,
        )
        self._packed = len(tokens)
        return self._verified(tree, out.logits[0], capture.take() if capture is not None else None, sampler, position)

    def _fast_rows(self, root: int, tree: DraftTree) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """This lane's part of a fast-path step: packed tokens, RoPE positions, and the CSR
        ancestor lists (`DraftTree.ancestor_lists`, indices local to the lane)."""
        tokens, depths = tree.packed(root)
        starts, paths = tree.ancestor_lists()
        return tokens, depths + (self.past_len + self.position_offset), starts, paths

    def _fast_verified(self, tree: DraftTree, logits: np.ndarray, row: int, sampler: Sampler | None,
                       position: int) -> VerifiedTree:
        """The verification from this lane's logits rows (N, V) of a fast-path step whose packed
        ``row`` is its root; with SAM+ViSkip's capture on, the root's attention mass on the image
        (same definition as the stock capture)."""
        self.last_logits = logits
        self._packed = len(logits)
        capture = self._capture
        image_attention = None
        if capture is not None and capture.enabled and self._image_positions is not None \
                and len(self._image_positions):
            image_attention = self._fast.root_image_attention(self._kv, self._image_positions.cpu().numpy(), row)
        return self._verified(tree, torch.from_numpy(logits), image_attention, sampler, position)

    def _verified(self, tree: DraftTree, logits: torch.Tensor, image_attention: float | None,
                  sampler: Sampler | None, position: int) -> VerifiedTree:
        ids, topk_logits, argmax = self._top_rows(logits)
        if sampler is None:
            accepted = acceptance.greedy(tree, argmax)
        else:
            accepted, draws = acceptance.sampled(tree, logits, sampler, position)
            for row, token in draws.items():
                argmax[row] = token
        return VerifiedTree(tree=tree, topk_ids=ids, topk_logits=topk_logits, argmax=argmax, accepted=accepted,
                            image_attention=image_attention)

    @torch.inference_mode()
    def commit(self, accepted: Sequence[int]) -> None:
        """Keep the root's and the accepted nodes' KV entries, drop the rest."""
        keep = [0] + [i + 1 for i in accepted]
        if self._kv is not None:
            self._kv.commit(keep)
            self.past_len = self._kv.length
            self._packed = 0
            return
        compact_cache(self.cache, self.past_len, keep, self._packed)
        self.past_len += len(keep)
        self._packed = 0

    @property
    def holds_cache(self) -> bool:
        """Whether a request's KV cache is held (stock or fast)."""
        return self.cache is not None or self._kv is not None

    @contextlib.contextmanager
    def measuring(self, prompt: Sequence[int] | np.ndarray) -> Iterator[MeasuringSession]:
        """A session for timing decode steps after ``prompt`` (token ids, no image): its KV
        cache is prefilled, image-attention capture is off (the stock attention path is what
        is timed), and on leaving the cache is freed and the capture restored. The cache is
        the target's own business: the profiler only calls the session's ``step`` and
        ``restore``."""
        capturing = self._capture is not None and self._capture.enabled
        self.capture_image_attention(False)
        try:
            ids = torch.from_numpy(np.asarray(prompt, dtype=np.int64).reshape(1, -1))
            _, root = self.prefill(ModelInputs(input_ids=ids))
            yield MeasuringSession(self, root, self.past_len)
        finally:
            self.release()
            if capturing:
                self.capture_image_attention(True)

    def _truncate(self, length: int) -> None:
        """Forget committed positions past ``length`` (a measuring session reuses one prefix)."""
        count = self.past_len - length
        if count <= 0:
            return
        if self._kv is not None:
            self._kv.length -= count
        else:
            self.cache.crop(-count)
        self.past_len = length

    def verify_cost(self) -> CostProfile:
        """What verifying N tokens costs here: the profile set by `use_cost_profile`, else the
        cached one for this model/dtype/threads/machine (measured once, ~15 s, if missing).
        An automatic profile is looked up again when its key changes (e.g. the thread count)."""
        from recap.verifier.profile import load_or_measure, profile_key

        if self.cost_profile is not None and self._cost_key is None:
            return self.cost_profile
        key = profile_key(self)
        if self.cost_profile is None or key != self._cost_key:
            self.cost_profile = load_or_measure(self)
            self._cost_key = key
        return self.cost_profile

    def use_cost_profile(self, spec: str | os.PathLike | CostProfile | None) -> CostProfile | None:
        """Set the verify-cost profile: ``auto`` (or None) resolves lazily on first use,
        ``flat`` simulates free verification, a file or a `CostProfile` is used as given
        (see `recap.verifier.profile.resolve_profile`). Returns the profile, None for auto."""
        from recap.verifier.profile import resolve_profile

        self._cost_key = None
        self.cost_profile = None if spec is None or spec == "auto" else resolve_profile(self, spec)
        return self.cost_profile

    def release(self) -> None:
        """Free the request's KV cache."""
        self.cache = None
        self._kv = None
        self._image_positions = None
        if self._capture is not None:
            self._capture.arm(None, -1)

    def _top_rows(self, logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Top-K ids/logits and the argmax per row, computed on the device and moved to the
        host in a single transfer (ids are exact in float64)."""
        values, ids = torch.topk(logits, self.top_k, dim=-1)
        argmax = first_argmax(logits, values, ids)
        packed = torch.cat([ids.double(), values.double(), argmax.double()], dim=1).cpu().numpy()
        k = self.top_k
        return packed[:, :k].astype(np.int64), packed[:, k : 2 * k].astype(np.float32), \
            packed[:, 2 * k].astype(np.int64)

    @torch.inference_mode()
    def stock_generate(self, inputs: ModelInputs, max_new_tokens: int,
                       eos_token_ids: Sequence[int] | None = None) -> list[int]:
        """Plain greedy ``model.generate(do_sample=False)`` on stock transformers.

        A clean greedy config is used so that sampling-oriented defaults a checkpoint may
        carry (repetition penalty, top-k...) do not apply: RECAP reproduces argmax decoding.
        """
        eos = list(self.eos_token_ids if eos_token_ids is None else eos_token_ids)
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos or None,
                                  pad_token_id=(eos[0] if eos else 0))
        kwargs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.extra.items()}
        input_ids = inputs.input_ids.to(self.device)
        out = self.model.generate(input_ids=input_ids, generation_config=config, **kwargs)
        return out[0, input_ids.shape[1]:].tolist()


@dataclass
class MeasuringSession:
    """Decode steps over a fixed prefix (`TargetModel.measuring`): each ``step`` is what one
    decode step pays the target, ``restore`` puts the cache back to the prefix, outside the
    timed part."""

    target: TargetModel
    root: int
    """The token after the prefix (prefill's first token): every step's root."""
    context_len: int
    """Tokens cached before every step."""

    def step(self, tree: DraftTree) -> None:
        """``verify(root, tree)`` then ``commit([])`` (the root's KV entry is kept, as in decoding)."""
        if self.target.past_len != self.context_len:
            raise RuntimeError("restore() the session before the next step")
        self.target.verify(self.root, tree)
        self.target.commit([])

    def restore(self) -> None:
        """Back to ``context_len`` cached tokens, so every step sees the same context."""
        self.target._truncate(self.context_len)


def _sliding_window(config: Any) -> int | None:
    """The attention window of sliding-window layers, if the model has any.

    The tree mask gives every node the whole cached prefix, which equals sliding-window
    attention only while the sequence fits in the window; `decode` refuses longer runs."""
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    uses_window = "sliding_attention" in layer_types or getattr(config, "use_sliding_window", False)
    return int(window) if uses_window and window else None


def _flatten_text(messages: list[Message]) -> str:
    parts = []
    for message in messages:
        content = message.get("content", "")
        if isinstance(content, str):
            parts.append(content)
        else:
            parts.extend(item.get("text", "") for item in content if isinstance(item, dict))
    return " ".join(parts)
