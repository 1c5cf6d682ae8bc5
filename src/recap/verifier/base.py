"""`TargetModel`: one interface over unmodified Hugging Face models.

prefill(inputs) -> Top-K rows at every prompt position and the first greedy token;
verify(root, tree) -> one packed forward, Top-K row and argmax at every node;
commit(accepted) -> KV compaction. The adapter here says how a prompt and an image become
model inputs, which tokens may be drafted and which prompt rows a method reads; the steps
run on a lane of one of two runners, transformers' own forward (`recap.verifier.stock`) or
the project's kernels (`recap.verifier.fast`). Family adapters (Qwen-VL, LLaVA) override the
hooks marked below.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from recap.core import (
    ROWS_WANTED,
    CostProfile,
    DraftTree,
    PromptRows,
    RowsWanted,
    VerifiedTree,
)
from recap.errors import InputError
from recap.verifier.image_attention import ImageAttentionCapture
from recap.verifier.inputs import LanguageInputs, Message, ModelInputs, flatten_text
from recap.verifier.kernels.stored import without_float_copy
from recap.verifier.prompt_rows import after_headers, answer_header, wanted_positions
from recap.verifier.protocol import BaseTarget
from recap.verifier.sampling import Sampler
from recap.verifier.stock import StockLane, refuse_unreadable, stock_generate

WEIGHTS = ("auto", "stored", "float")
"""What the fast kernels read (`TargetModel.weights`): ``stored`` GGUF blocks, ``float`` the
model's tensors, ``auto`` stored where the model came from a GGUF file whose blocks match."""

class TargetModel(BaseTarget):
    """Base adapter: a decoder-only causal LM, a `recap.verifier.protocol.Target` with every
    optional ability (context limit, sliding window, image-attention capture, cost profile,
    sampling). Subclasses override the hooks marked below."""

    family = "causal-lm"
    accepts_images = False
    causal_images = True
    """Whether an image's rows attend causally at prefill (`recap.verifier.vision_language`)."""
    can_sample = True

    def __init__(self, model: torch.nn.Module, processor: Any, *, top_k: int = 8, kernels: str = "auto",
                 weights: str = "auto", gguf_file: str | os.PathLike | None = None):
        if weights not in WEIGHTS:
            raise InputError(f"unknown weights {weights!r}; choose one of: {', '.join(WEIGHTS)}")
        self.model = model.eval()
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.top_k = top_k
        self.text_config = model.config.get_text_config(decoder=True)
        self.vocab_size = int(self.text_config.vocab_size)
        self.max_context = int(getattr(self.text_config, "max_position_embeddings", 0) or 1 << 30)
        self.layer_window = _layer_window(self.text_config)
        """The window of the model's sliding-window layers, where its config marks them
        (``layer_types``): both lanes apply it per layer, exactly; None: no such layers."""
        self.sliding_window = None if self.layer_window else _unmarked_window(self.text_config)
        self.excluded_tokens = frozenset(self._image_token_ids())
        self.image_token: int | None = None
        """The image placeholder token (a vision-language adapter's)."""
        self.capture: ImageAttentionCapture | None = None
        """The image-attention capture (`capture_image_attention`), shared by every lane."""
        self.cost_profile: CostProfile | None = None
        """Verify-cost profile handed to cost-aware proposers; None: resolved on first use."""
        self._cost_key: dict | None = None
        self.float_copy = not without_float_copy(model)
        """False for a model built from its GGUF file without float weights (`recap.load`)."""
        self.parameter_count = sum(parameter.numel() for parameter in model.parameters())
        """The model's parameters, counted at load (some may be dropped later: `FloatCopies`)."""
        self.gguf_file = None if gguf_file is None else Path(gguf_file)
        """The GGUF file the model was de-quantised from, whose blocks the fast kernels read."""
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._weights_wanted = weights
        self.fast_runner: Any = None
        """What every lane on the fast kernels shares (`recap.verifier.fast.FastRunner`), once used."""
        self.kernels = "stock"
        """``fast`` (the project's kernels) or ``stock`` (transformers' forward): `use_kernels`."""
        self.lane: Any = StockLane(self)
        """This request's state on the runner in use (`StockLane` or `FastLane`)."""
        self.prefix_scope = ""
        """Whose cached prompt prefixes this request may reuse (`PrefixCache`; the server: its tenant)."""
        self._rows_wanted: RowsWanted = "all"
        self.use_kernels(kernels)

    def _new_lane(self) -> Any:
        return self.fast_runner.lane(self) if self.kernels == "fast" else StockLane(self)

    @property
    def batches(self) -> bool:
        """On the fast kernels, lanes share one forward per step; stock verifies them in turn."""
        return self.kernels == "fast"

    def shares_forward_with(self, other: object) -> bool:
        """Whether ``other`` holds a request on this one's fast kernels (one forward: `verify_batch`)."""
        return isinstance(other, TargetModel) and self.kernels == other.kernels == "fast" \
            and other.fast_runner is self.fast_runner and self.lane.holds_cache and other.lane.holds_cache

    def fork(self) -> TargetModel:
        """Another request lane on the same model: the weights, runner, tokenizer and cost
        profile shared, its own KV state (`recap.batching` runs each request on one)."""
        lane = copy.copy(self)
        lane.lane, lane.prefix_scope, lane._rows_wanted = lane._new_lane(), "", "all"
        return lane

    # ----------------------------------------------------------------- family hooks
    def _image_token_ids(self) -> list[int]:
        """Placeholder tokens the vision encoder fills in; never drafted, never seeded."""
        return []

    def _build_inputs(self, messages: list[Message], image: Image.Image | None) -> ModelInputs:
        if image is not None:
            raise InputError(f"{self.name} is a text-only model: it cannot take an image")
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True, return_tensors="pt")["input_ids"]
        else:
            ids = self.tokenizer(flatten_text(messages), return_tensors="pt")["input_ids"]
        return ModelInputs(input_ids=ids)

    def prompt_positions(self, inputs: ModelInputs) -> tuple[torch.Tensor, int]:
        """Position ids for the prompt, and the offset later steps add to the cached length."""
        return torch.arange(inputs.input_ids.shape[1], device=self.device)[None], 0

    # ----------------------------------------------------------------- kernels and weights
    def use_kernels(self, kernels: str = "auto") -> str:
        """Choose the step path between requests: ``auto`` (``fast`` where the architecture is
        supported), ``fast`` or ``stock``; returns it. The fast runner is built here, once."""
        from recap.verifier.kernels import KERNELS, unsupported

        if kernels not in KERNELS:
            raise InputError(f"unknown kernels {kernels!r}; choose one of: {', '.join(KERNELS)}")
        if kernels != "stock":
            reason = unsupported(self.model)
            if reason is not None and kernels == "fast":
                raise InputError(f"--kernels fast does not support {self.name}: {reason}")
            kernels = "stock" if reason is not None else "fast"
        if self.fast_runner is None:
            refuse_unreadable(self, kernels, self._weights_wanted)
            if kernels == "fast":
                from recap.verifier.fast import FastRunner

                self.fast_runner = FastRunner(self, self._weights_wanted)
        if self.fast_runner is not None:
            self.fast_runner.float_weights(needed=kernels == "stock")
        if kernels != self.kernels:
            self.kernels = kernels  # an automatic cost profile follows: the kernels are part of its key
            self.lane = self._new_lane()
        return self.kernels

    def use_weights(self, weights: str) -> str:
        """Switch what the fast steps read (``stored`` or ``float``) between requests; returns it."""
        if weights not in ("stored", "float"):
            raise InputError(f"use_weights takes stored or float, got {weights!r}")
        if self.kernels != "fast" or weights == self.weights:
            return self.weights
        return self.fast_runner.use_weights(self, weights)

    @property
    def weights(self) -> str:
        """What the decode steps read: ``stored`` (GGUF blocks) or ``float`` (the model's tensors)."""
        return self.fast_runner.weights if self.kernels == "fast" else "float"

    @property
    def decoder(self) -> Any:
        """The fast kernels' `FastDecoder` in use; None on stock."""
        return self.fast_runner.decoder if self.kernels == "fast" else None

    @property
    def prefix_cache(self) -> Any:
        """Recent prompts' KV rows on the fast kernels (`recap.verifier.kernels.prefix.PrefixCache`)."""
        return None if self.fast_runner is None else self.fast_runner.prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, cache: Any) -> None:
        if self.fast_runner is not None:  # the stock path reuses no prefix
            self.fast_runner.prefix_cache = cache

    @property
    def cost_row_block(self) -> int:
        """How a step's cost grows with its packed rows (`FastDecoder.row_block`; stock: 1)."""
        return self.decoder.row_block if self.kernels == "fast" else 1

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
    def eos_token_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        eos = self.tokenizer.eos_token_id if eos is None else eos
        return [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

    def prompt_length(self, inputs: ModelInputs) -> int:
        return int(inputs.input_ids.shape[1])

    # ----------------------------------------------------------------- prompts
    def prepare(self, prompt: str | list[Message], image: Image.Image | None = None) -> ModelInputs:
        """Turn a prompt (text, or chat messages) and an optional image into model inputs."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if not messages or not flatten_text(messages).strip():
            raise InputError("the prompt is empty")
        inputs = self._build_inputs(messages, image)
        length = inputs.input_ids.shape[1]
        if length >= self.max_context:
            raise InputError(f"the prompt is {length} tokens long; {self.name} takes at most "
                             f"{self.max_context - 1} before generating")
        return inputs

    def keep_prompt_rows(self, rows: RowsWanted = "all") -> RowsWanted:
        """Which prompt rows the next prefill computes (`recap.verifier.prompt_rows`); one request's."""
        if rows not in ROWS_WANTED:
            raise ValueError(f"prompt rows must be one of {', '.join(ROWS_WANTED)}, got {rows!r}")
        self._rows_wanted = rows
        return rows

    def wanted_positions(self, prompt: np.ndarray, rows: RowsWanted) -> np.ndarray | None:
        """The positions whose logits a prefill computes for ``rows`` (None: all)."""
        return wanted_positions(prompt, rows, self.eligible(prompt), self.answer_mask)

    def answer_mask(self, prompt: np.ndarray) -> np.ndarray:
        """(P,) bool: the prompt positions inside earlier assistant turns (`answer_header`)."""
        return after_headers(np.asarray(prompt).reshape(-1), self.answer_header, self._special_ids())

    @functools.cached_property
    def answer_header(self) -> tuple[int, ...]:
        """The tokens that open an assistant turn in this model's chat prompts
        (`recap.verifier.prompt_rows.answer_header`); empty where not known."""
        return answer_header(self)

    def _special_ids(self) -> set[int]:
        return set(getattr(self.tokenizer, "all_special_ids", []) or [])

    def report_prompt(self, prompt: np.ndarray, topk_ids: np.ndarray, topk_logits: np.ndarray,
                    image_attention: float | None = None) -> PromptRows:
        """What prefill reports to a proposer: the prompt's Top-K rows and `eligible` positions."""
        return PromptRows(ids=prompt, topk_ids=topk_ids, topk_logits=topk_logits, eligible=self.eligible(prompt),
                          vocab_size=self.vocab_size, excluded_tokens=self.excluded_tokens,
                          image_attention=image_attention)

    def eligible(self, prompt: np.ndarray) -> np.ndarray:
        """Which prompt positions may seed token-keyed memories: not image placeholders, not
        special tokens."""
        special = self._special_ids()
        return np.array([t not in self.excluded_tokens and t not in special for t in prompt.tolist()], dtype=bool)

    # ----------------------------------------------------------------- one request's steps
    def prefill(self, inputs: ModelInputs, sampler: Sampler | None = None) -> tuple[PromptRows, int]:
        """Run the prompt, keep its KV cache; return its Top-K rows and the first token, greedy
        or drawn by ``sampler`` (not cached yet: it is the next root)."""
        return self.lane.prefill(inputs, self._spend_rows_wanted(), sampler)

    def prefill_chunks(self, inputs: ModelInputs) -> Any:
        """The prompt's prefill as chunks the caller runs (fast kernels); None: ``prefill`` runs it."""
        if self.kernels != "fast":
            return None
        chunked = self.lane.chunks(inputs, self._rows_wanted)
        if chunked is not None:
            self._spend_rows_wanted()
        return chunked

    def _spend_rows_wanted(self) -> RowsWanted:
        """The prompt rows this request asked for; the next prefill keeps them all unless told."""
        wanted, self._rows_wanted = self._rows_wanted, "all"
        return wanted

    def verify(self, root: int, tree: DraftTree, sampler: Sampler | None = None, position: int = 0) -> VerifiedTree:
        """One forward over [root] + tree nodes, each seeing the prefix and its ancestors; the
        greedy or (``sampler``, ``position``: the root row's output position) sampled walk."""
        if not self.lane.holds_cache:
            raise RuntimeError("verify() before prefill()")
        return self.lane.verify(root, tree, sampler, position)

    def commit(self, accepted: Sequence[int]) -> None:
        """Keep the root's and the accepted nodes' KV entries, drop the rest."""
        self.lane.commit([0] + [i + 1 for i in accepted])

    def release(self) -> None:
        """Free the request's KV cache."""
        self.lane.release()
        if self.capture is not None:
            self.capture.arm(None, -1)

    @property
    def past_len(self) -> int:
        """Tokens of this request whose K/V are cached."""
        return self.lane.past_len

    @property
    def holds_cache(self) -> bool:
        """Whether a request's KV cache is held (stock or fast)."""
        return self.lane.holds_cache

    @property
    def last_logits(self) -> np.ndarray | None:
        """The fast path's logits (N, V) of the last verify (a reused buffer), for tests."""
        return getattr(self.lane, "last_logits", None)

    def stock_generate(self, inputs: ModelInputs, max_new_tokens: int,
                       eos_token_ids: Sequence[int] | None = None) -> list[int]:
        """Plain greedy ``model.generate(do_sample=False)`` (`recap.verifier.stock.stock_generate`)."""
        return stock_generate(self, inputs, max_new_tokens, eos_token_ids)

    # ----------------------------------------------------------------- cost
    def verify_cost(self) -> CostProfile:
        """What verifying N tokens costs here: the profile set by `use_cost_profile`, else the
        cached one for this model / dtype / threads / machine (measured once if missing), looked
        up again when its key changes."""
        from recap.verifier.profile import load_or_measure, profile_key

        if self.cost_profile is not None and self._cost_key is None:
            return self.cost_profile
        key = profile_key(self)
        if self.cost_profile is None or key != self._cost_key:
            self.cost_profile = load_or_measure(self)
            self._cost_key = key
        return self.cost_profile

    def use_cost_profile(self, spec: str | os.PathLike | CostProfile | None) -> CostProfile | None:
        """Set the verify-cost profile: ``auto`` (or None) resolved on first use, ``flat``, a file or a
        `CostProfile` (`recap.verifier.profile.resolve_profile`). Returns it, None for auto."""
        from recap.verifier.profile import resolve_profile

        self._cost_key = None
        self.cost_profile = None if spec is None or spec == "auto" else resolve_profile(self, spec)
        return self.cost_profile


def _layer_window(config: Any) -> int | None:
    """The window of the layers ``config.layer_types`` marks ``sliding_attention`` (None: none)."""
    window = getattr(config, "sliding_window", None)
    return int(window) if window and "sliding_attention" in (getattr(config, "layer_types", None) or []) else None


def _unmarked_window(config: Any) -> int | None:
    """A sliding window the config declares without saying which layers use it (Mistral's
    ``sliding_window``, ``use_sliding_window`` without layer types): the tree mask gives every
    node the whole cached prefix, which equals that attention only while the sequence fits in
    the window, so `decode` refuses longer runs."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


__all__ = ["LanguageInputs", "Message", "ModelInputs", "TargetModel"]
