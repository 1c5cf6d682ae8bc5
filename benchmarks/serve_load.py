"""Throughput and latency of `recap serve` through its HTTP API, ar vs recap.

For each method a fresh server (in this process, a real uvicorn on 127.0.0.1) answers the
same requests at concurrency 1, 4 and 8: held-out demo VLM scenes with "Describe the image."
(or built-in prompts on a text model), after an untimed warm-up of a few requests. Printed:
requests/s, completion tokens/s, P50/P95 latency per request, mean tau; ``--out`` writes JSON.
The server decodes one request at a time, so concurrency adds waiting, not throughput.

    .venv/bin/python benchmarks/serve_load.py [--model recap-demo-vlm] [--requests 16] [--threads 1]
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

from recap.models import load  # noqa: E402
from recap.serve import ServerConfig, create_app  # noqa: E402


def _messages(model: str, n: int, offset: int) -> list[list[dict]]:
    if model != "recap-demo-vlm":
        from recap.prompts import TEXT_PROMPTS as prompts

        return [[{"role": "user", "content": prompts[(offset + i) % len(prompts)]}] for i in range(n)]
    from recap.demo_vlm.scenes import HELD_OUT_START, make_example

    out = []
    for i in range(n):
        buffer = io.BytesIO()
        make_example(HELD_OUT_START + offset + i).image().save(buffer, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        out.append([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "Describe the image."}]}])
    return out


def _run_server(target, model: str, method: str):
    app = create_app(target, ServerConfig(model_name=model, method=method, max_queue=256))
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


def _ask(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", timeout=600,
                          json={"model": model, "messages": messages, "max_tokens": max_tokens})
    response.raise_for_status()
    body = response.json()
    return {"latency": time.perf_counter() - start, "tokens": body["usage"]["completion_tokens"],
            "tau": body["recap"]["tau"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="recap-demo-vlm")
    parser.add_argument("--methods", default="ar,recap")
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--requests", type=int, default=16, help="timed requests per concurrency level")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load(args.model, dtype="float32")
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    for method in args.methods.split(","):
        server, thread, url = _run_server(target, args.model, method)
        try:
            for messages in _messages(args.model, args.warmup, 10_000):
                _ask(url, args.model, messages, args.max_tokens)
            for level, concurrency in enumerate(levels):
                batch = _messages(args.model, args.requests, 100 * level)
                start = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as pool:
                    results = list(pool.map(_ask, [url] * len(batch), [args.model] * len(batch), batch,
                                            [args.max_tokens] * len(batch)))
                wall = time.perf_counter() - start
                latencies = sorted(r["latency"] for r in results)
                row = {"method": method, "concurrency": concurrency, "requests": len(results),
                       "requests_per_s": len(results) / wall,
                       "tokens_per_s": sum(r["tokens"] for r in results) / wall,
                       "p50_s": statistics.median(latencies),
                       "p95_s": latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))],
                       "tau": statistics.mean(r["tau"] for r in results)}
                rows.append(row)
                print(f"{method:>6} c={concurrency}: {row['requests_per_s']:.2f} req/s, "
                      f"{row['tokens_per_s']:.1f} tok/s, P50 {row['p50_s']:.2f} s, P95 {row['p95_s']:.2f} s, "
                      f"tau {row['tau']:.2f}", flush=True)
        finally:
            server.should_exit = True
            thread.join(60)
    meta = {"model": args.model, "threads": args.threads, "max_tokens": args.max_tokens,
            "requests_per_level": args.requests, "warmup": args.warmup}
    print("\n| method | concurrency | req/s | tok/s | P50 latency | P95 latency | tau |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['method']} | {row['concurrency']} | {row['requests_per_s']:.2f} | {row['tokens_per_s']:.1f} | "
              f"{row['p50_s']:.2f} s | {row['p95_s']:.2f} s | {row['tau']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
