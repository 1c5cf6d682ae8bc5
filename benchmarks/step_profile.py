"""Where one decode step's time goes: an AR step and verifies of N = 2, 4, 8, 16 packed
tokens, split into linear layers, attention, norms, element-wise work, mask building, cache
update/compaction, logits/Top-K and the rest (Python dispatch, embedding), on the stock
transformers path and on the fast kernels (`recap.verifier.kernels`).

    python benchmarks/step_profile.py --model smollm2-135m --threads 1
    python benchmarks/step_profile.py --model recap-demo-vlm --threads 1 --json out.json
    python benchmarks/step_profile.py --model smollm2-135m --dtype bfloat16

Method: a synthetic prompt of --context tokens, then for each N a random tree of N - 1
nodes verified and committed (root only) --repeats times after a warm-up, in the target's
measuring session (`TargetModel.measuring`: the cache is restored after each step); per
category the median over repeats. Stock categories come from forward hooks on the model's
modules (a hook costs a few microseconds, counted in "other"); fast categories from timing
each kernel call. Thread count pinned, read back after the run (torch's and the kernels'),
printed, and a run whose counts differ from --threads refused.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import recap  # noqa: E402
import recap.verifier.stock as stock_lane  # noqa: E402
from recap.verifier import acceptance  # noqa: E402
from recap.verifier.kernels import decoder as fast_decoder  # noqa: E402
from recap.verifier.kernels import (
    ops,  # noqa: E402
    quantized_linear,  # noqa: E402
)
from recap.verifier.kernels.linear import Linear  # noqa: E402
from recap.verifier.kernels.threads import check_read_back, read_back  # noqa: E402
from recap.verifier.profile import (
    measuring,  # noqa: E402
    random_tree,  # noqa: E402
)

CATEGORIES = ("linear", "attention", "norm", "elementwise", "mask", "cache", "logits/top-k", "other")
clock = time.perf_counter


class Timer:
    def __init__(self):
        self.spent = collections.defaultdict(float)

    def wrap(self, category, function):
        def timed(*args, **kwargs):
            start = clock()
            try:
                return function(*args, **kwargs)
            finally:
                self.spent[category] += clock() - start
        return timed


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def instrument(target, timer: Timer):
    """Attribute time to categories for the path the target runs."""
    with contextlib.ExitStack() as stack:
        mask = timer.wrap("mask", stock_lane.tree_attention_mask)
        stack.enter_context(patched(stock_lane, "tree_attention_mask", mask))
        stack.enter_context(patched(stock_lane, "compact_cache", timer.wrap("cache", stock_lane.compact_cache)))
        stack.enter_context(patched(acceptance, "top_rows", timer.wrap("logits/top-k", acceptance.top_rows)))
        if target.kernels == "fast":
            for name, category in (("rms_norm", "norm"), ("add_rms_norm", "norm"), ("rope", "elementwise"),
                                   ("silu_mul", "elementwise"),
                                   ("gelu_tanh_mul", "elementwise"), ("write_cache", "cache"),
                                   ("tree_attention", "attention")):
                stack.enter_context(patched(ops, name, timer.wrap(category, getattr(ops, name))))
            stack.enter_context(patched(Linear, "__call__", timer.wrap("linear", Linear.__call__)))
            for three in ("linear_three", "linear_three_paired"):  # q, k, v as one (SameInput)
                stack.enter_context(patched(quantized_linear, three,
                                            timer.wrap("linear", getattr(quantized_linear, three))))
            stack.enter_context(patched(ops.QuadAttention, "__call__",
                                        timer.wrap("attention", ops.QuadAttention.__call__)))
            kv_commit = fast_decoder.KVCache.commit
            stack.enter_context(patched(fast_decoder.KVCache, "commit", timer.wrap("cache", kv_commit)))
        else:
            handles = []
            starts: dict[int, float] = {}

            def pre(module, _args):
                starts[id(module)] = clock()

            def post(category):
                def hook(module, _args, _out):
                    timer.spent[category] += clock() - starts.pop(id(module))
                return hook

            decoder = recap.verifier.kernels.args.language_model(target.model)
            for module in decoder.modules():
                kind = type(module).__name__
                if isinstance(module, torch.nn.Linear):
                    category = "linear"
                elif kind.endswith("RMSNorm"):
                    category = "norm"
                elif kind.endswith("Attention"):
                    category = "attention"  # linear layers inside are subtracted below
                elif kind.endswith("MLP"):
                    category = "mlp"
                else:
                    continue
                handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post(category))]
            head = target.model.get_output_embeddings()
            handles += [head.register_forward_pre_hook(pre), head.register_forward_hook(post("linear"))]
            stack.callback(lambda: [h.remove() for h in handles])
        yield


def profile(target, sizes, context: int, repeats: int, seed: int = 0) -> dict[int, dict[str, float]]:
    rng = np.random.default_rng(seed)
    pool = np.arange(100, min(target.vocab_size, 20000))
    with measuring(target, rng.choice(pool, context)) as session:
        return _profile(target, session, sizes, repeats, pool, rng)


def _profile(target, session, sizes, repeats: int, pool, rng) -> dict[int, dict[str, float]]:
    trees = {n: random_tree(n - 1, pool, rng) for n in sizes}
    out = {}
    for n in sizes:
        samples = collections.defaultdict(list)
        for repeat in range(repeats + 2):  # two warm-ups
            timer = Timer()
            with instrument(target, timer):
                start = clock()
                session.step(trees[n])  # verify + commit of the root
                total = clock() - start
            session.restore()
            if repeat < 2:
                continue
            spent = dict(timer.spent)
            if target.kernels == "stock":  # attention modules include q/k/v/o; MLPs include gate/up/down
                mlp = spent.pop("mlp", 0.0)
                spent["attention"] = max(0.0, spent.get("attention", 0.0) - _inner_linear(target, spent, "attn"))
                spent["elementwise"] = max(0.0, mlp - _inner_linear(target, spent, "mlp"))
            spent["other"] = total - sum(v for k, v in spent.items() if k in CATEGORIES)
            spent["total"] = total
            for key, value in spent.items():
                samples[key].append(value)
        out[n] = {key: statistics.median(values) * 1e3 for key, values in samples.items()}
    return out


_LINEAR_SHARE: dict[str, float] = {}


def _inner_linear(target, spent, part):
    """Linear time inside attention (q/k/v/o) or MLP (gate/up/down) modules, by weight bytes."""
    if not _LINEAR_SHARE:
        decoder = recap.verifier.kernels.args.language_model(target.model)
        sizes = {"attn": 0, "mlp": 0}
        for layer in decoder.layers:
            sizes["attn"] += sum(p.numel() for p in layer.self_attn.parameters())
            sizes["mlp"] += sum(p.numel() for p in layer.mlp.parameters())
        head = target.model.get_output_embeddings().weight.numel()
        total = sizes["attn"] + sizes["mlp"] + head
        _LINEAR_SHARE.update({k: v / total for k, v in sizes.items()})
    return spent.get("linear", 0.0) * _LINEAR_SHARE[part]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sizes", default="1,2,4,8,16")
    parser.add_argument("--json", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    target = recap.load(args.model, dtype=args.dtype)
    results = {}
    ran = {}
    for kernels in ("stock", "fast"):
        target.use_kernels(kernels)
        results[kernels] = profile(target, sizes, args.context, args.repeats)
        ran[kernels] = read_back(kernels)  # what ran, not what was asked
        check_read_back(args.threads, ran[kernels], f"the {kernels} step profile")
    print(f"# step profile: {args.model}, {args.dtype}, {args.threads} thread(s) (read back: "
          f"torch {ran['fast']['torch']}, kernels {ran['fast']['kernels']}), "
          f"{args.context} cached tokens, median of {args.repeats} (ms)\n")
    header = ["kernels", "N", *CATEGORIES, "total"]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for kernels, rows in results.items():
        for n, spent in rows.items():
            print("| " + " | ".join([kernels, str(n), *(f"{spent.get(c, 0.0):.1f}" for c in CATEGORIES),
                                     f"**{spent['total']:.1f}**"]) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "dtype": args.dtype,
                                               "threads": args.threads, "threads_ran": ran,
                                               "context": args.context,
                                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
