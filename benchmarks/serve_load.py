"""Throughput and latency of `recap serve` through its HTTP API, by method and concurrency.

For each method a fresh server (in this process, a real uvicorn on 127.0.0.1, the prefix cache
emptied so no method prefills from rows an earlier one left) answers the
same requests at each concurrency level, after an untimed warm-up: the first turns of MMSpec
items, topics interleaved (text only; ``--model recap-demo-vlm`` takes held-out demo scenes
with "Describe the image." instead). A method is ``NAME[:each][@B]``: ``:each`` makes every
request size its own tree as it would alone (no shared budget), ``@B`` caps the batch at B
requests (``@1`` is the one-request-at-a-time server). Every answer is compared with greedy
decoding of its prompt alone (mismatches are printed and counted). ``--replicas 0,1,2`` runs
each method on the single-process server (0) and behind N Ray replicas (one CPU each);
``--tenants N`` sends request i with the i mod N-th of N API keys. Printed: requests/s,
completion tokens/s, P50/P95 latency, mean tau, mean requests per step; ``--out`` writes
JSON and ``--plot`` a PNG of tokens/s and P50 latency by concurrency.

    .venv/bin/python benchmarks/serve_load.py --model smollm2-135m \\
        --methods ar,sam,recap,recap:each,recap@1 --concurrency 1,2,4,8 --plot docs/serve_load.png
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from recap.decoding import decode  # noqa: E402
from recap.models import load  # noqa: E402
from recap.proposers import make_proposer  # noqa: E402
from recap.serve import ServerConfig, create_app  # noqa: E402


def _mmspec_messages(count: int) -> list[list[dict]]:
    """First turns of MMSpec items, one topic after another, as chat messages (text only)."""
    from recap.bench import data

    items = data.load_items(data.mmspec_path("mmspec"))
    by_topic: dict[str, list] = {}
    for item in items:
        by_topic.setdefault(item.topic, []).append(item)
    order = [item for group in zip(*by_topic.values()) for item in group]
    return [[{"role": "system", "content": data.MMSPEC_SYSTEM_PROMPT},
             {"role": "user", "content": data.quote_answers(item.turns[0], [])}] for item in order[:count]]


def _scene_messages(count: int) -> list[list[dict]]:
    from recap.demo_vlm.scenes import HELD_OUT_START, make_example

    out = []
    for i in range(count):
        buffer = io.BytesIO()
        make_example(HELD_OUT_START + i).image().save(buffer, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        out.append([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "Describe the image."}]}])
    return out


def _method(spec: str) -> tuple[str, bool, int | None]:
    """``NAME[:each][@B]`` -> (method, shared budget, max batch)."""
    name, _, batch = spec.partition("@")
    name, _, budget = name.partition(":")
    return name, budget != "each", int(batch) if batch else None


def _keys(tenants: int) -> dict[str, str] | None:
    """One API key per tenant (None: the keyless one-tenant server)."""
    return None if tenants <= 1 else {f"serve-load-key-{i:04d}": f"tenant{i}" for i in range(tenants)}


def _run_server(target, model: str, spec: str, *, replicas: int = 0, tenants: int = 1, threads: int = 1,
                dtype: str = "float32"):
    """A fresh server for ``spec``: in this process (``replicas`` 0) or fronting that many Ray
    replicas (`recap.serve.scale`, one CPU and ``threads`` threads each)."""
    method, shared, max_batch = _method(spec)
    make_engine = None
    if replicas:
        from recap.serve.scale import ReplicaSpec, scaled_engine_factory

        make_engine = scaled_engine_factory(
            ReplicaSpec(model=model, dtype=dtype, threads=threads, method=method, max_queue=256, max_batch=max_batch,
                        shared_budget=shared), replicas, cpus_per_replica=1)
    app = create_app(target, ServerConfig(model_name=model, method=method, max_queue=256, max_batch=max_batch,
                                          shared_budget=shared, max_tokens_limit=4096, api_keys=_keys(tenants)),
                     make_engine)
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return app, server, thread, f"http://127.0.0.1:{port}"


def _ask(url: str, model: str, messages: list[dict], max_tokens: int, key: str | None = None) -> dict:
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", timeout=900,
                          headers={"Authorization": f"Bearer {key}"} if key else None,
                          json={"model": model, "messages": messages, "max_tokens": max_tokens})
    response.raise_for_status()
    body = response.json()
    return {"latency": time.perf_counter() - start, "tokens": body["usage"]["completion_tokens"],
            "tau": body["recap"]["tau"], "text": body["choices"][0]["message"]["content"]}


def _plot(rows: list[dict], path: str, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(row["method"] for row in rows):
        mine = [row for row in rows if row["method"] == method]
        levels = [row["concurrency"] for row in mine]
        left.plot(levels, [row["tokens_per_s"] for row in mine], marker="o", label=method)
        right.plot(levels, [row["p50_s"] for row in mine], marker="o", label=method)
    left.set(xlabel="concurrent clients", ylabel="completion tokens/s (all requests)", xscale="log")
    right.set(xlabel="concurrent clients", ylabel="P50 latency per request (s)", xscale="log")
    for axis in (left, right):
        axis.minorticks_off()
        axis.set_xticks(sorted({row["concurrency"] for row in rows}))
        axis.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.grid(alpha=0.3)
    left.legend()
    figure.suptitle(f"recap serve, {meta['model']}, {meta['threads']} thread(s), {meta['max_tokens']} tokens, "
                    f"{meta['requests_per_level']} requests per level")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--methods", default="ar,sam,recap,recap:each,recap@1")
    parser.add_argument("--concurrency", default="1,2,4,8")
    parser.add_argument("--requests", type=int, default=16, help="timed requests per concurrency level")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--replicas", default="0",
                        help="comma-separated replica counts: 0 is the single-process server, N > 0 fronts N Ray "
                             "replicas (recap-decoding[ray])")
    parser.add_argument("--tenants", type=int, default=1,
                        help="API keys, one tenant each; request i uses key i mod N (1: no keys)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load(args.model, dtype=args.dtype)
    levels = [int(c) for c in args.concurrency.split(",")]
    make = _scene_messages if args.model == "recap-demo-vlm" else _mmspec_messages
    prompts = make(args.warmup + args.requests * len(levels))
    warmup, timed = prompts[:args.warmup], prompts[args.warmup:]
    greedy = []
    for messages in timed:  # what every answer must be
        tokens = decode(target, make_proposer("ar"), target.prepare(messages), max_new_tokens=args.max_tokens).tokens
        greedy.append(target.tokenizer.decode(tokens, skip_special_tokens=True))
    keys = list(_keys(args.tenants) or [None])
    rows, mismatches = [], 0
    for replicas, spec in [(int(r), m) for r in args.replicas.split(",") for m in args.methods.split(",")]:
        label = spec if not replicas else f"{spec} x{replicas} replicas"
        if getattr(target, "prefix_cache", None) is not None:
            target.prefix_cache.clear()  # else a later method's prompts would prefill from an earlier one's rows
        app, server, thread, url = _run_server(target, args.model, spec, replicas=replicas, tenants=args.tenants,
                                               threads=args.threads, dtype=args.dtype)

        def ask(pair, u=url):
            i, messages = pair
            return _ask(u, args.model, messages, args.max_tokens, keys[i % len(keys)])

        try:
            with ThreadPoolExecutor(max(1, min(4, args.warmup))) as pool:
                list(pool.map(ask, enumerate(warmup)))
            for level, concurrency in enumerate(levels):
                batch = timed[level * args.requests:(level + 1) * args.requests]
                expected = greedy[level * args.requests:(level + 1) * args.requests]
                engine = app.state.engine
                steps_before = getattr(engine.batch, "steps", 0)
                start = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as pool:
                    results = list(pool.map(ask, enumerate(batch)))
                wall = time.perf_counter() - start
                steps = getattr(engine.batch, "steps", 0) - steps_before  # 0 through replicas: not counted
                wrong = [i for i, (r, want) in enumerate(zip(results, expected)) if r["text"] != want]
                mismatches += len(wrong)
                for i in wrong:
                    print(f"  MISMATCH {label} c={concurrency} request {i}: {results[i]['text'][:60]!r} vs "
                          f"{expected[i][:60]!r}", flush=True)
                latencies = sorted(r["latency"] for r in results)
                iterations = sum(r["tokens"] / r["tau"] for r in results)
                row = {"method": label, "concurrency": concurrency, "requests": len(results),
                       "requests_per_s": len(results) / wall,
                       "tokens_per_s": sum(r["tokens"] for r in results) / wall,
                       "p50_s": statistics.median(latencies),
                       "p95_s": latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))],
                       "tau": statistics.mean(r["tau"] for r in results),
                       "requests_per_step": iterations / steps if steps else 0.0, "mismatches": len(wrong)}
                rows.append(row)
                print(f"{label:>12} c={concurrency}: {row['requests_per_s']:.2f} req/s, "
                      f"{row['tokens_per_s']:.1f} tok/s, P50 {row['p50_s']:.2f} s, P95 {row['p95_s']:.2f} s, "
                      f"tau {row['tau']:.2f}, {row['requests_per_step']:.2f} requests/step", flush=True)
        finally:
            server.should_exit = True
            thread.join(60)
    meta = {"model": args.model, "dtype": args.dtype, "threads": args.threads, "max_tokens": args.max_tokens,
            "requests_per_level": args.requests, "tenants": args.tenants, "replicas": args.replicas,
            "warmup": args.warmup, "kernels": target.kernels, "prefix_cache": "cleared before each method",
            "mismatches": mismatches}
    print("\n| method | concurrency | req/s | tok/s | P50 latency | P95 latency | tau | requests/step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['method']} | {row['concurrency']} | {row['requests_per_s']:.2f} | {row['tokens_per_s']:.1f} | "
              f"{row['p50_s']:.2f} s | {row['p95_s']:.2f} s | {row['tau']:.2f} | {row['requests_per_step']:.2f} |")
    print(f"\nanswers different from greedy decoding alone: {mismatches}")
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    if args.plot:
        _plot(rows, args.plot, meta)
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
