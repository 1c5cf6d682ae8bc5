"""The project's own decode and verify steps on CPU: fast at small batch and batch-invariant.

- `lanes`: the one summation order of every dot product and sum (fixed partial sums, fused
  multiply-adds, a fixed final tree), so no compiler or CPU can change a bit;
- `linear`: the linear-layer kernel: register blocks sized to the step (4x4 and 8x2 on
  AVX-512; 3x4 with 12x1 / 6x2 remainders on 16-register CPUs), each element in `lanes` order;
- `quantized`, `quantized_linear`, `stored`: a GGUF file's blocks read as stored (memory-mapped,
  checked against the model's float weights, de-quantised in registers by the very float32
  operations transformers' loader used), so a model that came from GGUF decodes from the
  file's bytes with the float model's logits, bit for bit;
- `threads`: the kernels run on torch's thread count, and torch's count is never changed;
- `exp`: a float32 ``exp`` that vectorises (softmax, SiLU);
- `ops`: norms, RoPE, SiLU, tree attention over per-node ancestor lists (four queries of a
  kv head at a time, `QuadAttention`, on models with 3 or more query heads per kv head);
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

from recap.verifier.kernels.args import DecoderArgs, unsupported
from recap.verifier.kernels.cache import KVCache
from recap.verifier.kernels.decoder import FastDecoder

KERNELS_REVISION = 16
"""Bumped when the fast kernels' speed or arithmetic changes (2: the 2-row block, `exp32`; 3:
the 3x4 block on 16-register CPUs; 4: the 16x1 block for 1-row steps on AVX-512; 5: quad
attention; 6: the 12x1 / 6x2 remainder blocks; 7: 16-bit weights widened in registers; 8: every
sum in `lanes` order, new bits, no 16x1 block; 9: K-quant scales unpacked once per 32 weights;
10: q, k, v and gate, up one kernel on GGUF blocks, each residual add inside the next norm; 11:
the 4x8 block of paired rows for steps of 8 rows and more, same bits; 12: GGUF blocks of two
weight rows de-quantised side by side for steps of 1-4 rows, same bits; 13: steps of 8 and 16
computed rows de-quantised in registers per 8 rows instead of into panels, same bits; 14: steps
of 12 computed rows on the 2x12 block, one pair of weight rows de-quantised once, same bits;
15: attention's softmax loops vectorised again, same bits; 16: steps of 24 and 32 computed rows
in registers too, same bits), so
a cost profile measured on older kernels is measured again (`recap.verifier.profile`)."""

KERNELS = ("auto", "fast", "stock")
"""``auto``: ``fast`` on CPU where the architecture is supported, ``stock`` elsewhere."""

__all__ = ["KERNELS", "KERNELS_REVISION", "DecoderArgs", "FastDecoder", "KVCache", "unsupported"]
