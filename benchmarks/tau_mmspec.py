"""Acceptance length tau and host overhead of RECAP, its ablations and the baselines against AR
on MMSpec questions.

    .venv/bin/python benchmarks/tau_mmspec.py --model smollm2-135m --dtype float32 --per-topic 10 \\
        --configs recap,no-confidence,gate --out out/tau-fp32.jsonl
    .venv/bin/python benchmarks/tau_mmspec.py --dtype bfloat16 --configs recap,pld,token-recycling --out ...

A config is a registered method name (``recap``, ``pld``, ``token-recycling``, ...) or a RECAP
ablation name. Host overhead per iteration = proposer time (propose + observe), target excluded.

Text-only: the model sees the first question of each item without its image (SmolLM2 is a
text model). Per topic, every configuration is a fresh stream (U cleared at the topic
boundary, then carried across the topic's inputs; C/G reset per request), as in the paper.
Each input runs AR first (the reference) and then every configuration; any output that
differs from AR is counted as a mismatch. Rows are appended to ``--out`` as they finish, and
a rerun skips the (topic, item, config) rows already there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections import defaultdict
from pathlib import Path

import torch

import recap
from recap.proposers import ABLATIONS, PROPOSERS, Proposer, RecapProposer, make_proposer

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mmspec" / "mmspec.jsonl"


def load_items(path: Path, per_topic: int) -> dict[str, list[dict]]:
    topics: dict[str, list[dict]] = defaultdict(list)
    with open(path) as handle:
        for line in handle:
            item = json.loads(line)
            if len(topics[item["topic"]]) < per_topic:
                topics[item["topic"]].append(item)
    return dict(topics)


def make(config: str) -> Proposer:
    """A fresh stream: a registered method, or RECAP with one ablation."""
    if config in ABLATIONS and config not in PROPOSERS:
        return RecapProposer(ablation=config)
    return make_proposer(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--per-topic", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--configs", default="recap")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--markdown", nargs="*", default=None, metavar="RESULTS",
                        help="only print the Markdown table of these result files (and --out)")
    args = parser.parse_args()
    if args.markdown is not None:
        print(markdown([*args.markdown, args.out]))
        return
    torch.set_num_threads(args.threads)
    configs = args.configs.split(",")
    target = recap.load(args.model, dtype=args.dtype)
    done = set()
    if os.path.exists(args.out):
        with open(args.out) as handle:
            done = {(r["topic"], r["id"], r["config"]) for r in map(json.loads, handle)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as out:
        for topic, items in load_items(Path(args.data), args.per_topic).items():
            streams = {config: make(config) for config in configs}  # fresh streams per topic
            for item in items:
                inputs = target.prepare(item["turns"][0])
                reference = recap.decode(target, recap.make_proposer("ar"), inputs,
                                         max_new_tokens=args.max_new_tokens)
                for config in configs:
                    if (topic, item["id"], config) in done:
                        continue
                    result = recap.decode(target, streams[config], inputs, max_new_tokens=args.max_new_tokens)
                    row = {"topic": topic, "id": item["id"], "config": config, "dtype": args.dtype,
                           "tokens": len(result.tokens), "iterations": len(result.iterations), "tau": result.tau,
                           "identical": result.tokens == reference.tokens,
                           "mean_tree": statistics.mean(it.draft_size for it in result.iterations)
                           if result.iterations else 0.0,
                           "host_ms_per_iteration": 1e3 * statistics.mean(it.propose_s + it.observe_s
                                                                          for it in result.iterations)
                           if result.iterations else 0.0,
                           "threads": torch.get_num_threads()}
                    if isinstance(streams[config], RecapProposer):
                        row["u_rows"] = streams[config].memory_counts()[0]
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(f"{topic:>18} {item['id']} {config:>14} tau {result.tau:.2f} "
                          f"{'ok' if row['identical'] else 'MISMATCH'}", flush=True)
    summarise(args.out)


def markdown(paths: list[str]) -> str:
    """The tau table of one or more result files as Markdown (configs x topics)."""
    rows = []
    for path in paths:
        with open(path) as handle:
            rows.extend(json.loads(line) for line in handle)
    topics = list(dict.fromkeys(row["topic"] for row in rows))
    configs = list(dict.fromkeys(row["config"] for row in rows))
    lines = ["| config | " + " | ".join(topics) + " | overall | host ms/iter | inputs | identical to AR |",
             "| --- |" + " --- |" * (len(topics) + 4)]
    for config in configs:
        mine = [r for r in rows if r["config"] == config]
        cells = [f"{statistics.mean([r['tau'] for r in mine if r['topic'] == t] or [float('nan')]):.2f}"
                 for t in topics]
        identical = sum(r["identical"] for r in mine)
        host = [r["host_ms_per_iteration"] for r in mine if "host_ms_per_iteration" in r]
        host_cell = f"{statistics.median(host):.3f}" if host else "-"
        lines.append(f"| {config} | " + " | ".join(cells) + f" | {statistics.mean(r['tau'] for r in mine):.2f} | "
                     f"{host_cell} | {len(mine)} | {identical}/{len(mine)} |")
    return "\n".join(lines)


def summarise(path: str) -> None:
    """Per config: tau (mean over inputs of per-input tau) per topic and overall, mismatches."""
    with open(path) as handle:
        rows = [json.loads(line) for line in handle]
    by_config: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_config[row["config"]].append(row)
    topics = sorted({row["topic"] for row in rows})
    print(f"{'config':>14} " + " ".join(f"{t[:12]:>12}" for t in topics) + f" {'overall':>8} mismatches")
    for config, config_rows in by_config.items():
        per_topic = [statistics.mean([r["tau"] for r in config_rows if r["topic"] == t] or [float("nan")])
                     for t in topics]
        overall = statistics.mean(r["tau"] for r in config_rows)
        mismatches = sum(not r["identical"] for r in config_rows)
        print(f"{config:>14} " + " ".join(f"{v:12.2f}" for v in per_topic) + f" {overall:8.2f} {mismatches}")


if __name__ == "__main__":
    main()
