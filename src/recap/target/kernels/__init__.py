"""The project's own decode and verify steps on CPU: fast at small batch and batch-invariant.

- `linear`: the linear-layer kernel, one compiled loop for every row count;
- `ops`: norms, RoPE, SiLU, tree attention over per-node ancestor lists;
- `cache`: a KV cache written in place at explicit slots;
- `args`: the supported decoder families as one config (`DecoderArgs`) and `unsupported`;
- `decoder`: `FastDecoder`, the whole step on the model's own weights.

`TargetModel` enters it from `verify`/`commit` when its ``kernels`` is ``fast``; prefill
stays on transformers. Every node of a packed verify gets, bit for bit, the logits a plain
one-token step at its position gets on these kernels (`tests/test_kernels.py`).
"""

from recap.target.kernels.args import DecoderArgs, unsupported
from recap.target.kernels.cache import KVCache
from recap.target.kernels.decoder import FastDecoder

KERNELS = ("auto", "fast", "stock")
"""``auto``: ``fast`` on CPU where the architecture is supported, ``stock`` elsewhere."""

__all__ = ["KERNELS", "DecoderArgs", "FastDecoder", "KVCache", "unsupported"]
