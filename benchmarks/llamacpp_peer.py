"""recap against the engine CPU users run instead: llama.cpp on the very GGUF file, paired.

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36   # a source build, ~5 minutes
    python benchmarks/llamacpp_peer.py --data ../shared/data/mmspec --limit 2 --threads 1,2

(llama-cpp-python is not a project dependency.) Where the CPU reports AMX but its tile
instructions fault (an Intel KVM guest here: SIGILL in ``ggml_backend_amx_mul_mat`` at the
first prompt), build without them: add ``-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8
-mno-amx-bf16'`` and the same ``-DCMAKE_CXX_FLAGS`` to ``CMAKE_ARGS``.

For each thread count, every unit (MMSpec first turns, ``--limit`` per topic, the chat
template's prompt token ids, identical for every engine) is decoded greedily for up to
``--max-new-tokens`` tokens, stopping at the model's end-of-turn tokens, by:

- ``llama.cpp``: llama-cpp-python's generator at temperature 0 (argmax), the same file;
- ``llama.cpp-pld``: the same with its prompt-lookup speculation
  (``LlamaPromptLookupDecoding(num_pred_tokens=10)``, ``logits_all=True``);
- ``ar``, ``recap`` and the best baseline ``pld``: this project, reading the file's blocks as
  stored (`recap.load(..., weights="stored")`), and ``ar-float`` (plain AR on the float
  weights: its outputs must equal ``ar``'s, the run fails otherwise).

Engines run in a rotating order per unit, after one warm-up each and a short untimed pause
before every call (so one engine's spinning worker threads do not slow the next). Each of our
methods reuses only its own earlier prompts' rows (its prefix-cache scope), as each llama.cpp
engine reuses only its own previous call's (before 2026-12-07 our methods on the stored
weights shared one scope, so one that ran after another on a unit skipped most of its
prefill); each row records the prompt tokens our method copied from its cache; recap's
cost profile is measured before llama.cpp's threads exist; tokens/s is new tokens
over the whole call (prompt processing included), ratios are per unit (paired) and
averaged; each call's time to its first token (the prompt's prefill and one token) is
recorded apart, with tokens/s after it, to show which half of a call an engine wins; and
it reports how often each llama.cpp output equals llama.cpp's own plain greedy output and
how often it equals ours (llama.cpp's CPU kernels are not batch-invariant: its speculation
may change its answers). Thread counts are set
(torch, numba, llama.cpp) and read back after each pass; a pass whose counts differ is
refused. numba compiles inside a timed call of ours (a cold cache, a kernel edited since the
last run) are recorded per row and warned about (`recap.bench.compiles`). Writes ``--out``
(JSON) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SETTLE_S = 0.3
"""Pause before each timed call: both engines' thread pools spin a while after a parallel
region (llama.cpp's, numba's OpenMP); on 2 cores a spinning pool slows the next engine."""


def _llama(path: Path, threads: int, speculative: bool):
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    options = dict(n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)
    if speculative:
        options.update(draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10), logits_all=True)
    return Llama(str(path), **options)


def _llama_generate(llm, prompt: list[int], limit: int, stops: set[int]) -> tuple[list[int], float, float]:
    """Tokens, seconds for the whole call, seconds to the first token (the prompt's prefill)."""
    started = time.perf_counter()
    first_s = 0.0
    out: list[int] = []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        first_s = first_s or time.perf_counter() - started
        if token in stops:
            break
        out.append(int(token))
        if len(out) >= limit:
            break
    return out, time.perf_counter() - started, first_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default=None)
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default="llamacpp_peer.json")
    args = parser.parse_args()

    import numba
    import torch

    import recap
    from recap.bench import data as bench_data
    from recap.bench.compiles import WARNING, CompileWatch
    from recap.bench.sources import resolve_data
    from recap.decoding import decode
    from recap.models import gguf_source
    from recap.proposers import make_proposer
    from recap.verifier.kernels.threads import check_read_back, read_back

    path = gguf_source(args.model)
    if path is None:
        raise SystemExit(f"{args.model} did not come from a GGUF file")
    items = bench_data.select(bench_data.load_items(resolve_data(args.data)), None, args.limit)
    units = [unit for unit in bench_data.units_of(items) if unit.turn == 0]
    result: dict = {"model": args.model, "file": path.name, "units": [u.key for u in units], "passes": []}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        stored = recap.load(args.model, weights="stored")
        floats = recap.load(args.model, weights="float")
        prompts = [stored.prepare(bench_data.messages_for(unit, [])) for unit in units]
        stops = set(stored.eos_token_ids)
        stored.verify_cost()  # recap's cost profile, measured (once per machine) before llama.cpp's threads exist
        engines = {"llama.cpp": _llama(path, threads, False), "llama.cpp-pld": _llama(path, threads, True)}
        ours = {"ar": (stored, "ar"), "recap": (stored, "recap"), "pld": (stored, "pld"), "ar-float": (floats, "ar")}
        labels = [*engines, *ours]
        streams: dict = {}
        reused: dict = {}
        compiled: dict = {}

        def run(label: str, index: int, engines=engines, ours=ours, prompts=prompts, stops=stops,
                streams=streams, reused=reused, compiled=compiled) -> tuple[list[int], float, float]:
            if label in engines:
                return _llama_generate(engines[label], list(prompts[index].prompt_ids), args.max_new_tokens, stops)
            target, method = ours[label]
            target.prefix_scope = label  # each method reuses only its own earlier prompts' rows, as llama.cpp does
            topic = units[index].topic
            proposer = streams.setdefault((label, topic), make_proposer(method))
            before = target.prefix_cache.reused_tokens
            with CompileWatch() as watch:
                out = decode(target, proposer, prompts[index], max_new_tokens=args.max_new_tokens)
            reused[label] = target.prefix_cache.reused_tokens - before
            compiled[label] = watch.fields()
            return list(out.tokens), out.total_s, out.prefill_s

        for label in labels:  # warm-up: compile, first allocations, profiles
            run(label, 0)
        streams.clear()
        rows = []
        for index, unit in enumerate(units):
            order = labels[index % len(labels):] + labels[:index % len(labels)]
            row = {"unit": unit.key, "topic": unit.topic}
            for label in order:
                time.sleep(SETTLE_S)  # untimed: the other engine's worker threads stop spinning
                tokens, seconds, first_s = run(label, index)
                row[label] = {"tokens": tokens, "s": seconds, "tok_s": len(tokens) / seconds, "first_s": first_s,
                              "after_first_tok_s": max(len(tokens) - 1, 0) / max(seconds - first_s, 1e-9),
                              "prompt": len(prompts[index].prompt_ids)}
                if label in ours:
                    row[label]["reused_prompt_tokens"] = reused[label]
                    row[label].update(compiled[label])  # numba compiles inside this timed call (a cold cache)
            rows.append(row)
            print(f"{threads} thread(s) {unit.key}: " + ", ".join(f"{label} {row[label]['tok_s']:.1f}"
                                                               for label in labels), flush=True)
        ran = read_back(stored.kernels)
        for label, llm in engines.items():
            ran[label] = int(llm.context_params.n_threads)
        check_read_back(threads, ran, f"the {threads}-thread pass")
        mismatched = [row["unit"] for row in rows if row["ar-float"]["tokens"] != row["ar"]["tokens"]
                      or row["recap"]["tokens"] != row["ar"]["tokens"] or row["pld"]["tokens"] != row["ar"]["tokens"]]
        summary = {label: {"tok_s": statistics.mean(row[label]["tok_s"] for row in rows),
                           "vs_llama_cpp": statistics.mean(row[label]["tok_s"] / row["llama.cpp"]["tok_s"]
                                                           for row in rows),
                           "first_ms": 1000 * statistics.mean(row[label]["first_s"] for row in rows),
                           "after_first_vs_llama_cpp": statistics.mean(
                               row[label]["after_first_tok_s"] / row["llama.cpp"]["after_first_tok_s"] for row in rows)}
                   for label in labels}
        for label in ours:
            summary[label]["prompt_reused"] = sum(row[label]["reused_prompt_tokens"] for row in rows) / \
                sum(row[label]["prompt"] for row in rows)
        for label in engines:
            summary[label]["same_as_llama_cpp_greedy"] = sum(row[label]["tokens"] == row["llama.cpp"]["tokens"]
                                                             for row in rows)
            summary[label]["same_as_ours"] = sum(row[label]["tokens"] == row["ar"]["tokens"] for row in rows)
        compiles = [(row["unit"], label, row[label]["compile_s"]) for row in rows for label in ours
                    if row[label]["compiles"]]
        result["passes"].append({"threads": threads, "threads_ran": ran, "numba": numba.get_num_threads(),
                                 "weights": stored.weights, "mismatched_units": mismatched, "summary": summary,
                                 "compiled_units": compiles, "rows": rows})
        del engines
    Path(args.out).write_text(json.dumps(result, indent=1))
    for entry in result["passes"]:
        print(f"\n{args.model} ({path.name}), {len(units)} units, {args.max_new_tokens} new tokens, "
              f"{entry['threads']} thread(s) (read back: {entry['threads_ran']})\n")
        print("| engine | tok/s | vs llama.cpp (paired) | first token, ms | after it, vs llama.cpp | "
              "same as llama.cpp greedy | same as ours | prompt rows from its own cache |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for label, data in entry["summary"].items():
            same = [f"{data[key]}/{len(units)}" if key in data else "" for key in ("same_as_llama_cpp_greedy",
                                                                                  "same_as_ours")]
            share = f"{data['prompt_reused']:.0%}" if "prompt_reused" in data else ""
            print(f"| {label} | {data['tok_s']:.1f} | {data['vs_llama_cpp']:.2f}x | {data['first_ms']:.0f} | "
                  f"{data['after_first_vs_llama_cpp']:.2f}x | {same[0]} | {same[1]} | {share} |")
        if entry["mismatched_units"]:
            print(f"\nMISMATCH: our methods differ from ar on {entry['mismatched_units']}")
        if entry["compiled_units"]:
            print("\nwarning: " + WARNING.format(count=len(entry["compiled_units"]),
                                                 seconds=sum(s for *_, s in entry["compiled_units"]))
                  + f": {entry['compiled_units']}")
    return 1 if any(entry["mismatched_units"] for entry in result["passes"]) else 0


if __name__ == "__main__":
    sys.exit(main())
