"""The decoder step of the fast path: one forward over a packed tree (or one token) after a
cached prefix, on the model's own weights, every row bit-identical to a plain one-token step.

gpt-fast's shape: each block is a short composition (norm, qkv, rope, cache write, attend,
out; norm, gate/up, down), over preallocated buffers of shape (Mp, width) where Mp is the
step's row count padded for the linear kernel. Prompts are prefilled by the same step, as
chains (`recap.verifier.kernels.prefix`); an image's features come in as input vectors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from recap.verifier.kernels import ops, quantized, quantized_linear, threads
from recap.verifier.kernels.args import DecoderArgs, language_model
from recap.verifier.kernels.cache import KVCache
from recap.verifier.kernels.linear import ROW_BLOCK, GrownLinear, Linear, SameInput, padded_rows, read_only
from recap.verifier.kernels.stored import StoredWeights


def _weight(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's own storage as numpy (no copy): float32, or 16-bit floats as uint16 bits."""
    tensor = tensor.detach()
    if tensor.dtype == torch.float32:
        return tensor.numpy()
    return tensor.view(torch.int16).numpy().view(np.uint16)


def _vector(tensor: torch.Tensor | None) -> np.ndarray | None:
    """Small vectors (norm weights, biases) as float32 copies."""
    return None if tensor is None else tensor.detach().float().numpy().copy()


def _linear(module: torch.nn.Module, stored: np.ndarray | None = None) -> Linear | GrownLinear:
    """The module's weight read as stored in the model (float or 16-bit), or its GGUF blocks
    (``stored``, checked by `StoredWeights.blocks` to de-quantise to that weight; where the
    model grew rows past the file's, those rows stay float: `GrownLinear`)."""
    bias = _vector(getattr(module, "bias", None))
    if stored is None:
        return Linear(_weight(module.weight), bias, float16=module.weight.dtype == torch.float16)
    if len(stored) == module.weight.shape[0]:
        return Linear(stored, bias)
    split = len(stored)
    grown = Linear(np.ascontiguousarray(_weight(module.weight)[split:]), None if bias is None else bias[split:],
                   float16=module.weight.dtype == torch.float16)
    return GrownLinear(Linear(stored, None if bias is None else bias[:split]), grown)


@dataclass
class _Layer:
    input_norm: np.ndarray
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    mlp_norm: np.ndarray
    """The norm before the MLP (Llama's ``post_attention_layernorm``, Gemma's
    ``pre_feedforward_layernorm``)."""
    gate: Linear
    up: Linear
    down: Linear
    window: int = 0
    """Sliding attention window (0: every position)."""
    rope_kind: str | None = None
    """Key of this layer's rotary tables (None: the model's one table)."""
    attn_out_norm: np.ndarray | None = None
    """Gemma: the norm on the attention's output before its residual add."""
    mlp_out_norm: np.ndarray | None = None
    """Gemma: the norm on the MLP's output before its residual add."""
    q_norm: np.ndarray | None = None
    """Gemma 3: per-head RMSNorm weights of queries and keys (before RoPE)."""
    k_norm: np.ndarray | None = None
    qkv: SameInput = field(init=False)
    """q, k and v called as one (they read the same normed input)."""
    gate_up: SameInput = field(init=False)
    """gate and up called as one."""

    def __post_init__(self) -> None:
        self.qkv = SameInput((self.q, self.k, self.v))
        self.gate_up = SameInput((self.gate, self.up))

    def linears(self) -> tuple[Linear, ...]:
        return self.q, self.k, self.v, self.o, self.gate, self.up, self.down


class _Buffers:
    """Activations for steps of up to ``rows`` (padded) rows; rebuilt larger when needed.
    Never fewer than 4 rows: a layer without a 2-row block computes 2-row steps as 4."""

    def __init__(self, args: DecoderArgs, rows: int):
        self.rows = rows = max(rows, ROW_BLOCK)
        q_width, kv_width = args.heads * args.head_dim, args.kv_heads * args.head_dim

        def zeros(width: int) -> np.ndarray:
            return np.zeros((rows, width), np.float32)

        self.h, self.x, self.o = zeros(args.hidden), zeros(args.hidden), zeros(args.hidden)
        self.q, self.attn = zeros(q_width), zeros(q_width)
        self.k, self.v = zeros(kv_width), zeros(kv_width)
        self.heads_q = self.q.reshape(rows * args.heads, args.head_dim)  # views: one row per head
        self.heads_k = self.k.reshape(rows * args.kv_heads, args.head_dim)
        self.gate, self.up = zeros(args.intermediate), zeros(args.intermediate)
        self.logits = zeros(args.vocab)


class FastDecoder:
    """Decode / verify steps for a supported model (`recap.verifier.kernels.unsupported`)."""

    def __init__(self, model: torch.nn.Module, *, warm_rows: tuple[int, ...] = (1, 8),
                 stored: StoredWeights | None = None):
        """``stored``: the GGUF file the model was de-quantised from; its block tensors are then
        read as stored (each checked to de-quantise to the model's weight: `StoredWeights`)."""
        config = model.config.get_text_config(decoder=True)
        self.args = args = DecoderArgs.from_hf(config)
        decoder = language_model(model)
        self._rotary = decoder.rotary_emb

        self.stored_pairs: list[tuple[torch.nn.Parameter, np.ndarray]] = []
        """(model parameter, the GGUF blocks the kernels read in its place) for each weight
        read as stored (`recap.verifier.kernels.stored.FloatCopies` frees the floats)."""

        def blocks(role: str, layer: int | None, weight: torch.nn.Parameter) -> np.ndarray | None:
            if stored is None:
                return None
            found = stored.blocks(role, layer, weight, heads=args.heads, kv_heads=args.kv_heads)
            if found is not None and len(found) == weight.shape[0]:  # a grown weight keeps its floats
                self.stored_pairs.append((weight, found))
            return found

        embed_blocks = blocks("embed", None, decoder.embed_tokens.weight)
        def norm(module: torch.nn.Module) -> np.ndarray:  # Gemma's (1 + w), in float32 as its RMSNorm forms it
            weight = _vector(module.weight)
            return weight if not args.norm_offset else np.float32(args.norm_offset) + weight

        self.embed = _weight(decoder.embed_tokens.weight) if embed_blocks is None else read_only(embed_blocks)
        self._grown_embed = None if embed_blocks is None else \
            np.ascontiguousarray(_weight(decoder.embed_tokens.weight)[len(embed_blocks):]).astype(np.float32)
        """Embedding rows past the GGUF file's vocabulary (float32), for a stored embedding."""
        self._embed_float16 = decoder.embed_tokens.weight.dtype == torch.float16
        scale = getattr(decoder.embed_tokens, "embed_scale", None)  # Gemma: sqrt(hidden), a float32 buffer
        self.embed_scale = None if scale is None else np.float32(torch.as_tensor(scale, dtype=torch.float32).item())
        """What each embedding row is multiplied by (Gemma), None: nothing."""
        self.layers = []
        for i, layer in enumerate(decoder.layers):
            attn, mlp = layer.self_attn, layer.mlp
            modules = {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": attn.o_proj,
                       "gate": mlp.gate_proj, "up": mlp.up_proj, "down": mlp.down_proj}
            linears = {role: _linear(module, blocks(role, i, module.weight)) for role, module in modules.items()}
            extra = {}
            if args.sandwich_norms:
                extra = dict(attn_out_norm=norm(layer.post_attention_layernorm),
                             mlp_out_norm=norm(layer.post_feedforward_layernorm))
            if args.qk_norms:
                extra.update(q_norm=norm(attn.q_norm), k_norm=norm(attn.k_norm))
            mlp_norm = layer.pre_feedforward_layernorm if args.sandwich_norms else layer.post_attention_layernorm
            self.layers.append(_Layer(input_norm=norm(layer.input_layernorm), mlp_norm=norm(mlp_norm),
                                      window=args.windows[i] if args.windows else 0,
                                      rope_kind=args.rope_kinds[i] if args.rope_kinds else None, **extra, **linears))
        self.norm = norm(decoder.norm)
        self._rope_kinds = tuple(dict.fromkeys(layer.rope_kind for layer in self.layers))
        """The rotary tables a step gathers angles from (one, or Gemma 3's two)."""
        head = model.get_output_embeddings()
        self.head = _linear(head, blocks("head", None, head.weight))
        linears = [linear for layer in self.layers for linear in layer.linears()] + [self.head]
        self.weights = "stored" if any(linear.blocks for linear in linears) else "float"
        """``stored`` where some layer reads GGUF blocks as stored, else ``float``."""
        self.row_block = 1 if all(linear.remainders for linear in linears) else ROW_BLOCK
        """How a step's cost grows with its rows (`recap.core.cost.CostProfile.row_block`): in
        blocks of 4, or row by row where every layer runs the last 1 or 2 rows of a step past 4
        on a remainder block (3x4 machines; a step of 4k + 3 rows still costs 4k + 4)."""
        self.eps = float(getattr(decoder.norm, "variance_epsilon", args.eps))
        self.scale = float(getattr(decoder.layers[0].self_attn, "scaling", args.head_dim ** -0.5))
        self.quad_attention = ops.QuadAttention(args.heads, args.kv_heads, args.head_dim) \
            if ops.QuadAttention.suits(args.heads, args.kv_heads, args.head_dim) else None
        """Attention four queries of a kv head at a time (`ops.quad_attention`) where the model
        and this machine allow it, else one (row, head) at a time (`ops.tree_attention`)."""
        self._tables: dict[str | None, tuple[np.ndarray, np.ndarray]] = {}
        """Rotary cos/sin tables (P, D) by rope kind (`_Layer.rope_kind`)."""
        self._mrope_axis = self._mrope_axes(args.head_dim)
        self._buffers = _Buffers(args, padded_rows(max(warm_rows)))
        self._warm(warm_rows)

    # ------------------------------------------------------------------ set-up
    def _rope_tables(self, positions: int, kind: str | None) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin for positions [0, positions) at least, from the model's own rotary module
        (float32; ``kind``: its layer type for Gemma 3's two RoPE bases)."""
        known = self._tables.get(kind)
        if known is not None and positions <= len(known[0]):
            return known
        size = max(positions, 2 * len(known[0]) if known else 0, 256)
        ids = torch.arange(size)[None]
        extra = () if kind is None else (kind,)
        with torch.inference_mode():
            cos, sin = self._rotary(torch.zeros(1, dtype=torch.float32), ids, *extra)
        if cos.ndim == 4:  # (3, 1, P, D): M-RoPE sections; a text token's three coordinates are equal
            cos, sin = cos[0], sin[0]
        self._tables[kind] = tables = (np.ascontiguousarray(cos[0].float().numpy()),
                                       np.ascontiguousarray(sin[0].float().numpy()))
        return tables

    def _mrope_axes(self, dim: int) -> np.ndarray | None:
        """M-RoPE (Qwen2-VL / Qwen2.5-VL): which of a row's three coordinates (time, height,
        width) each rotary dimension turns by, as the model's rotary module recomposes them
        (``mrope_section`` over each half); None for plain RoPE."""
        section = getattr(self._rotary, "mrope_section", None)
        if not section:
            return None
        half = np.concatenate([np.full(width, i % 3, np.int64) for i, width in enumerate(section)])
        if len(half) != dim // 2:
            return None
        return np.concatenate([half, half])

    def _angles(self, positions: np.ndarray, kind: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Each row's cos/sin (M, D), gathered from the position tables of rope ``kind``:
        ``positions`` (M,), or (M, 3) M-RoPE coordinates (an image row's differ; a text row's
        are equal)."""
        cos, sin = self._rope_tables(int(positions.max()) + 1, kind)
        if positions.ndim == 1:
            return cos[positions], sin[positions]
        if self._mrope_axis is None:
            raise ValueError("3-D positions for a model without M-RoPE")
        rows, columns = positions[:, self._mrope_axis], np.arange(self.args.head_dim)
        return cos[rows, columns], sin[rows, columns]

    def _warm(self, rows: tuple[int, ...]) -> None:
        """Compile (or load from numba's cache) and run every kernel once, outside any timed step."""
        cache = self.new_cache(max(rows) + 1)
        for m in rows:
            starts = np.arange(m + 1, dtype=np.int64)
            self.forward(cache, np.zeros(m, np.int64), np.arange(m, dtype=np.int64), starts,
                         np.arange(m, dtype=np.int64))

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.args, capacity)

    # ------------------------------------------------------------------ the step
    def _embed(self, tokens: np.ndarray, out: np.ndarray) -> None:
        if quantized.format_of(self.embed.dtype) is not None:
            grown = tokens >= len(self.embed)
            quantized_linear.dequantize_rows(self.embed, np.where(grown, 0, tokens), out)
            if grown.any():
                out[np.flatnonzero(grown)] = self._grown_embed[tokens[grown] - len(self.embed)]
            return
        rows = self.embed[tokens]
        if rows.dtype == np.float32:
            out[: len(tokens)] = rows
        elif self._embed_float16:
            out[: len(tokens)] = rows.view(np.float16).astype(np.float32)
        else:
            out[: len(tokens)] = (rows.astype(np.uint32) << 16).view(np.float32)

    def _embed_scaled(self, tokens: np.ndarray, out: np.ndarray) -> None:
        """The rows' embeddings, times `embed_scale` where the model scales them (one float32
        multiply, as its embedding module does it)."""
        self._embed(tokens, out)
        if self.embed_scale is not None:
            out[: len(tokens)] *= self.embed_scale

    def forward(self, cache: KVCache, tokens: np.ndarray, positions: np.ndarray, starts: np.ndarray,
                paths: np.ndarray, embeds: Sequence[tuple[int, np.ndarray]] = (),
                logit_rows: np.ndarray | None = None) -> np.ndarray:
        """Logits (M, V) of ``tokens`` (M,) at RoPE ``positions`` (M,) or M-RoPE (M, 3); packed
        node i attends to the cache's prefix and to ``paths[starts[i]:starts[i+1]]`` (packed
        indices, root first, itself last). Their K/V are written at slots cache.length + i;
        `KVCache.commit` keeps the accepted ones. ``embeds``: (first row, (n, hidden) float32)
        input vectors that replace those rows' token embeddings (an image's features);
        ``logit_rows``: see `forward_batch`. The returned array is a view into a reused buffer."""
        return self.forward_batch([cache], tokens, positions, np.array([0, len(tokens)], np.int64), starts, paths,
                                  embeds, logit_rows)

    def forward_batch(self, caches: Sequence[KVCache], tokens: np.ndarray, positions: np.ndarray,
                      bounds: np.ndarray, starts: np.ndarray, paths: np.ndarray,
                      embeds: Sequence[tuple[int, np.ndarray]] = (),
                      logit_rows: np.ndarray | None = None) -> np.ndarray:
        """One step over the packed trees of B requests: request r owns rows
        ``bounds[r]:bounds[r+1]`` (bounds: (B+1,)) and ``caches[r]``; row a attends to its own
        cache's prefix and to ``paths[starts[a]:starts[a+1]]``, indices local to its request
        (0 = that request's root). Linear layers run once over all M rows (batch-invariant, so
        a row's result never depends on the other requests); attention and the cache write
        run per request. A request's logits are thus bit-identical to decoding it alone.
        ``logit_rows`` (ascending row indices; None: all): the rows whose logits the caller
        reads. The head, a fifth of a row's arithmetic on SmolLM2, runs on those alone (a
        prompt chunk whose Top-K rows no proposer asked for needs at most its last row's);
        the other rows of the returned array are left stale."""
        m = len(tokens)
        rows = padded_rows(m)
        if rows > self._buffers.rows:
            self._buffers = _Buffers(self.args, rows)
        angles = {kind: self._angles(positions, kind) for kind in self._rope_kinds}
        threads.follow_torch()
        spans = [(int(bounds[r]), int(bounds[r + 1]), cache) for r, cache in enumerate(caches)]
        for begin, end, cache in spans:
            cache.reserve(end - begin)
        quad = self.quad_attention
        plans = [quad.plan(cache.length, starts[begin:end + 1], end - begin) if quad else None
                 for begin, end, cache in spans]
        b, args, eps = self._buffers, self.args, self.eps
        self._embed_scaled(tokens, b.h)
        for first, vectors in embeds:
            b.h[first:first + len(vectors)] = vectors
        gated = ops.gelu_tanh_mul if args.activation == "gelu_pytorch_tanh" else ops.silu_mul
        for index, layer in enumerate(self.layers):
            cos, sin = angles[layer.rope_kind]
            if index:  # the last layer's MLP residual, then this layer's norm
                ops.add_rms_norm(b.h, b.o, layer.input_norm, eps, b.x, m)
            else:
                ops.rms_norm(b.h, layer.input_norm, eps, b.x, m)
            layer.qkv(b.x, (b.q, b.k, b.v), m)
            if layer.q_norm is not None:  # per head: the (rows, heads * D) buffers seen as (rows * heads, D)
                ops.rms_norm(b.heads_q, layer.q_norm, eps, b.heads_q, m * args.heads)
                ops.rms_norm(b.heads_k, layer.k_norm, eps, b.heads_k, m * args.kv_heads)
            ops.rope(b.q, args.heads, cos, sin, m)
            ops.rope(b.k, args.kv_heads, cos, sin, m)
            for (begin, end, cache), plan in zip(spans, plans):
                keys, values, count = cache.keys[index], cache.values[index], end - begin
                ops.write_cache(b.k[begin:end], keys, cache.length, args.kv_heads, count)
                ops.write_cache(b.v[begin:end], values, cache.length, args.kv_heads, count)
                if plan is not None:
                    quad(plan, b.q[begin:end], keys, values, paths, self.scale, b.attn[begin:end], layer.window)
                else:
                    ops.tree_attention(b.q[begin:end], keys, values, cache.length, starts[begin:end + 1], paths,
                                       self.scale, layer.window, b.attn[begin:end], count)
            layer.o(b.attn, b.o, m)
            if layer.attn_out_norm is not None:
                ops.rms_norm(b.o, layer.attn_out_norm, eps, b.o, m)
            ops.add_rms_norm(b.h, b.o, layer.mlp_norm, eps, b.x, m)  # the attention's residual
            layer.gate_up(b.x, (b.gate, b.up), m)
            gated(b.gate, b.up, m)
            layer.down(b.gate, b.o, m)
            if layer.mlp_out_norm is not None:
                ops.rms_norm(b.o, layer.mlp_out_norm, eps, b.o, m)
        ops.add_rms_norm(b.h, b.o, self.norm, eps, b.x, m)  # the last layer's MLP residual
        if logit_rows is None or len(logit_rows) == m:
            self.head(b.x, b.logits, m)
        elif len(logit_rows):
            self._head_rows(np.asarray(logit_rows, np.int64))
        return b.logits[:m]

    def _head_rows(self, picked: np.ndarray) -> None:
        """The head on the ``picked`` rows only (ascending): gathered to the buffer's first
        rows, computed there (the kernel's result for a row does not depend on which other
        rows ride along), and moved back to their own rows, last first so that none is
        overwritten before it is moved."""
        b, n = self._buffers, len(picked)
        b.x[:n] = b.x[picked]
        self.head(b.x, b.logits, n)
        for i in range(n - 1, -1, -1):
            if picked[i] != i:
                b.logits[picked[i]] = b.logits[i]

    def root_image_attention(self, cache: KVCache, image_positions: np.ndarray, row: int = 0,
                             keys: int | None = None) -> float:
        """SAM+ViSkip's gate after a step: the final layer's softmax attention of the request's
        root (packed ``row`` of the step, which sees the prefix and itself: ``keys`` cached
        rows, by default the prefix + 1; of them the last ``window`` where that layer slides),
        averaged over heads, summed over the image positions it sees (float32 scores, as the
        stock capture computes them under the layer's mask)."""
        args = self.args
        keys = cache.length + 1 if keys is None else keys
        window = self.layers[-1].window
        first = keys - window if window and keys > window else 0
        q = torch.from_numpy(self._buffers.q[row].reshape(args.heads, args.head_dim))  # final layer's, after RoPE
        seen = torch.from_numpy(cache.keys[-1][:, first:keys])                     # (H_kv, keys - first, D)
        seen = seen.repeat_interleave(args.heads // args.kv_heads, dim=0)
        probs = torch.softmax(torch.einsum("hd,hsd->hs", q, seen) * self.scale, dim=-1)
        positions = np.asarray(image_positions, np.int64)
        positions = positions[(positions >= first) & (positions < keys)] - first
        return float(probs[:, torch.from_numpy(positions)].sum(dim=-1).mean())
