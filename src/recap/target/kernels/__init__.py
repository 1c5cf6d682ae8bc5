"""The project's own decode and verify steps on CPU: fast at small batch and batch-invariant.

- `linear`: the linear-layer kernel, one compiled loop for every row count;
- `ops`: norms, RoPE, SiLU, tree attention over per-node ancestor lists;
- `cache`: a KV cache written in place at explicit slots;
- `args`: the supported decoder families as one config (`DecoderArgs`) and `unsupported`;
- `decoder`: `FastDecoder`, the whole step on the model's own weights (one request, or
  several in one forward);
- `prefix`: text prompts prefilled as chains of rows, and the cache of shared prefixes.

`TargetModel` enters it from `prefill`/`verify`/`commit` when its ``kernels`` is ``fast``
(an image prompt's prefill stays on transformers). Every node of a packed verify gets, bit for bit, the logits a plain
one-token step at its position gets on these kernels (`tests/test_kernels.py`). The
kernels release the GIL, so a server's HTTP threads run while a step computes.
"""

from recap.target.kernels.args import DecoderArgs, unsupported
from recap.target.kernels.cache import KVCache
from recap.target.kernels.decoder import FastDecoder

KERNELS = ("auto", "fast", "stock")
"""``auto``: ``fast`` on CPU where the architecture is supported, ``stock`` elsewhere."""

__all__ = ["KERNELS", "DecoderArgs", "FastDecoder", "KVCache", "unsupported"]
