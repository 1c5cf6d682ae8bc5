"""Run by `tests/test_instruction_sets.py` in a subprocess whose numba compiles for the CPU that
``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` name: prints one JSON line with, per model, the
SHA-256 of the fast kernels' logits for a prefill and a packed verify, and what was compiled
(the target numba used and the vector registers one kernel's machine code names).

    python tests/isa_logits.py tiny-llama tiny-qwen2.5-vl
    python tests/isa_logits.py --reorder tiny-llama   # a negative control: another final sum
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core.registry import cpu_target  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

import recap  # noqa: E402
from recap.core import DraftTree  # noqa: E402
from recap.verifier.kernels import lanes, linear  # noqa: E402
from recap.verifier.kernels.linear import _block3  # noqa: E402


def logits_digest(name: str) -> str:
    """The fast kernels' logits of a one-token step after a prompt, then of a verify of a
    12-node tree (every node), hashed."""
    target = recap.load(name, kernels="fast")
    rng = np.random.default_rng(0)
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, 12)]
    tree = DraftTree(rng.integers(0, min(target.vocab_size, 1000), 12), parents)
    digest = hashlib.sha256()
    target.prefill(target.prepare("The sea, the ships on it and the birds above"))
    target.verify(42, DraftTree.empty())  # a plain one-token step
    digest.update(np.ascontiguousarray(target.last_logits).tobytes())
    target.commit([])
    target.verify(43, tree)
    digest.update(np.ascontiguousarray(target.last_logits).tobytes())
    target.release()
    return digest.hexdigest()


@njit
def _probe(x, w, out):  # pragma: no cover - compiled
    # one register block, compiled here and now (never from a cache) to read its machine code
    _block3(x, 0, w, (0, 1, 2), out, (0, 1, 2), np.zeros(0, np.float32))
    return lanes.dot(x[0], w[0])


def compiled() -> dict:
    """The target numba compiled for, the vector registers a register block's code uses, and
    the weight-row layout the layers picked for it."""
    x, w = np.ones((4, 64), np.float32), np.ones((3, 64), np.float32)
    _probe(x, w, np.zeros((4, 3), np.float32))
    code = "\n".join(_probe.inspect_asm().values())
    codegen = cpu_target.target_context.codegen()
    registers = re.findall(r"%([xyz]mm)(\d+)", code)
    return {"cpu": codegen._get_host_cpu_name(), "features": codegen._tm_features,
            "registers": sorted({kind for kind, _ in registers}),
            "register_numbers": sorted({int(number) for _, number in registers}), "fma": "vfmadd" in code,
            "weight_rows": linear.WEIGHT_ROWS}


@intrinsic
def _total_in_lane_order(typingctx, v):  # pragma: no cover - compiled
    """The partial sums added one after another: not `lanes.total`'s tree."""
    def codegen(context, builder, signature, args):
        value = builder.extract_element(args[0], ir.Constant(ir.IntType(32), 0))
        for i in range(1, lanes.LANES):
            value = builder.fadd(value, builder.extract_element(args[0], ir.Constant(ir.IntType(32), i)))
        return value
    return types.float32(v), codegen


def main(names: list[str]) -> int:
    if names and names[0] == "--reorder":  # before the first kernel compiles, which looks it up
        lanes.total = _total_in_lane_order
        names = names[1:]
    torch.set_num_threads(1)
    print(json.dumps({"compiled": compiled(), "logits": {name: logits_digest(name) for name in names}}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
