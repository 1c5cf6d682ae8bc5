"""``recap`` command line: generate, check, overhead, bench, demo, calibrate, train-demo-vlm, demo-vlm-data,
demo-vlm-memory.

Bad input (a missing image, an unknown model, an empty prompt...) is reported on one line
with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import torch

from recap.errors import InputError
from recap.models import BUILTIN, DTYPES
from recap.proposers import ABLATIONS, PROPOSERS, Proposer, make_proposer


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help=f"built-in name ({', '.join(BUILTIN)}) or a local Hugging Face model folder")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--threads", type=_positive, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--row-size", type=_positive, default=8,
                        help="Top-K row size the target reports to proposers (default 8)")
    _cost_option(parser)
    _kernels_option(parser)
    _sampling_options(parser)


def _kernels_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kernels", choices=["auto", "fast", "stock"], default="auto",
                        help="decode/verify steps: fast (the project's batch-invariant CPU kernels), stock "
                             "(transformers' forward); auto (default): fast on CPU where the model is supported")
    parser.add_argument("--weights", choices=["auto", "stored", "float"], default="auto",
                        help="what the fast steps read for a model that came from a GGUF file: stored (its "
                             "blocks, de-quantised in registers to the float weights, bit for bit), float (the "
                             "de-quantised copy); auto (default): stored where the file's blocks match")


def _sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy; > 0: lossless sampling with transformers' warpers")
    parser.add_argument("--top-k", type=int, default=None, help="sampling: keep the K likeliest tokens")
    parser.add_argument("--top-p", type=float, default=None, help="sampling: nucleus mass")


def _sampling(args: argparse.Namespace, seed: int | None):
    from recap.verifier.sampling import Sampling

    return Sampling.of(args.temperature, args.top_k, args.top_p, seed)


def _cost_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cost-profile", default="auto", metavar="{auto,flat,FILE}",
                        help="verify-cost profile for cost-aware drafting: auto (cached, measured once if "
                             "missing, corrected online by this run's verify times), flat (verification is "
                             "free: paper-sized trees) or a file from `recap calibrate --out`, used as given "
                             "(never corrected: choices independent of timing)")


class _Parser(argparse.ArgumentParser):
    """Usage errors on one line with exit status 2, like every other input error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _recap_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ablation", choices=list(ABLATIONS), default=None,
                        help="recap, recap-paper: change one ingredient (cost, calibration, continuations, fusion)")
    parser.add_argument("--budget", type=int, default=None,
                        help="recap: most recycled candidates a step, root excluded (63; recap-paper drafts all)")


def _make_method(args: argparse.Namespace) -> Proposer:
    """The proposer the arguments ask for; recap-only options on another method are an error."""
    options = {}
    if args.method in ("recap", "recap-paper"):
        if args.ablation:
            options["ablation"] = args.ablation
        if args.budget is not None:
            if args.budget < 0:
                raise InputError(f"--budget cannot be negative, got {args.budget}")
            options["budget"] = args.budget
        memory = getattr(args, "memory", None)
        if memory and os.path.exists(memory):
            options["memory_file"] = memory
    elif args.ablation or args.budget is not None or getattr(args, "memory", None):
        raise InputError("--ablation, --budget and --memory apply to --method recap and recap-paper only")
    return make_proposer(args.method, **options)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="recap", description="Lossless speculative decoding for VLMs and LMs.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    generate = commands.add_parser("generate", help="generate a reply to one prompt")
    _common(generate)
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--image", default=None, help="image file (vision-language models only)")
    generate.add_argument("--method", choices=list(PROPOSERS), default="recap")
    _recap_options(generate)
    generate.add_argument("--memory", default=None, metavar="FILE",
                          help="recap: token memory U to start from (if the file exists) and to save back after")
    generate.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    generate.add_argument("--seed", type=int, default=None, help="sampling: the seed (same seed, same text)")

    check = commands.add_parser("check", help="compare a method with model.generate(do_sample=False)")
    _common(check)
    check.add_argument("--method", choices=list(PROPOSERS), default="ar")
    _recap_options(check)
    check.add_argument("--prompts", type=_positive, default=30, help="number of built-in prompts")
    check.add_argument("--vary", action="store_true",
                       help="per prompt: a random token limit, and for half of them an EOS taken from the "
                            "reference output, so stops land inside accepted paths")
    check.add_argument("--seed", type=int, default=0, help="seeds --vary draws and, when sampling, the first sample")
    check.add_argument("--samples", type=_positive, default=1000,
                       help="with --temperature > 0: sampled generations per prompt for the distribution test")

    overhead = commands.add_parser("overhead", help="host-side cost per iteration of a method (no model needed)")
    overhead.add_argument("--method", choices=list(PROPOSERS), default="recap")
    overhead.add_argument("--vocab", type=_positive, default=49152)
    overhead.add_argument("--budget", type=int, default=63, help="recap: tree candidates, root excluded")
    overhead.add_argument("--requests", type=_positive, default=8, help="timed requests (after one warm-up)")
    overhead.add_argument("--max-new-tokens", type=int, default=128)
    overhead.add_argument("--seed", type=int, default=0)
    overhead.add_argument("--json", action="store_true", help="one JSON object (key total_ms_median: the total)")

    demo = commands.add_parser("demo", help="AR vs drafters on the demo VLM's scenes: identical outputs, speedup")
    demo.add_argument("--model", default="recap-demo-vlm", help="recap-demo-vlm (scenes) or a text model (prompts)")
    demo.add_argument("--methods", default="pld,sam,recap", help="comma-separated methods to compare with AR")
    demo.add_argument("--budget", type=int, default=None,
                      help="recap/recap-paper: recycled candidates per step, root excluded (default 63)")
    demo.add_argument("--out", default="demo-out", help="folder for the demo scenes' PNG images")
    demo.add_argument("--dtype", choices=list(DTYPES), default="float32")
    demo.add_argument("--threads", type=_positive, default=1)
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--memory", default="auto", metavar="FILE",
                      help="RECAP memory for the recap+memory column: auto (the demo VLM's shipped memory of "
                           "earlier requests), none, or a file")
    _cost_option(demo)
    _kernels_option(demo)
    _add_bench(commands)
    _add_calibrate(commands)
    _add_demo_vlm_data(commands)
    _add_demo_vlm_memory(commands)
    _add_serve(commands)

    train = commands.add_parser("train-demo-vlm", help="train the demo VLM's vision side (about 45 min on 2 cores)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--stage1-steps", type=_positive, default=None,
                       help="tower + projector without the LM: scene classes and scene words "
                            "(64 scenes a step; default 3000)")
    train.add_argument("--stage2-steps", type=_positive, default=None,
                       help="tower + projector through SmolLM2 (8 questions a step; default 1800)")
    train.add_argument("--threads", type=_positive, default=2)
    train.add_argument("--out", default=None,
                       help="weights file to write (default: the shipped src/recap/demo_vlm/weights/...)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    try:
        if getattr(args, "max_new_tokens", None) is not None and args.max_new_tokens < 1:
            raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
        if args.command == "generate":
            return _generate(args)
        if args.command == "check":
            return _check(args)
        if args.command == "overhead":
            return _overhead(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "train-demo-vlm":
            return _train_demo_vlm(args)
        if args.command == "calibrate":
            return _calibrate(args)
        if args.command == "demo-vlm-data":
            return _demo_vlm_data(args)
        if args.command == "demo-vlm-memory":
            return _demo_vlm_memory(args)
        if args.command == "serve":
            return _serve(args)
        from recap.demo import run_demo

        methods = tuple(m for m in args.methods.split(",") if m)
        unknown = [m for m in methods if m not in PROPOSERS or m in ("ar", "decoy", "random")]
        if unknown or not methods:
            real = [m for m in PROPOSERS if m not in ("ar", "decoy", "random")]
            raise InputError(f"--methods takes drafting methods ({', '.join(real)}); "
                             f"got {args.methods!r}")
        if args.budget is not None and args.budget < 0:
            raise InputError(f"--budget cannot be negative, got {args.budget}")
        return run_demo(args.model, methods, dtype=args.dtype, max_new_tokens=args.max_new_tokens,
                        budget=args.budget, out=args.out, cost_profile=args.cost_profile, memory=args.memory,
                        kernels=args.kernels, weights=args.weights)
    except InputError as error:
        print(f"recap: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("recap: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _train_demo_vlm(args: argparse.Namespace) -> int:
    from pathlib import Path

    from recap.demo_vlm.model import WEIGHTS
    from recap.demo_vlm.train import TrainConfig, train
    from recap.models import smollm2_folder

    out = Path(args.out) if args.out else WEIGHTS
    steps = {name: value for name, value in (("stage1_steps", args.stage1_steps), ("stage2_steps", args.stage2_steps))
             if value is not None}
    config = TrainConfig(seed=args.seed, **steps)
    train(smollm2_folder(), out, config)
    print(f"wrote {out} (loss curve: {out.with_suffix('.log.jsonl')})")
    return 0


def _note_text_only(args: argparse.Namespace, target) -> None:
    """sam-viskip gates on image attention; say once when there can be none."""
    if args.method == "sam-viskip" and not target.accepts_images:
        print(f"recap: note: {args.model} has no image tokens; sam-viskip behaves as sam", file=sys.stderr)


def _generate(args: argparse.Namespace) -> int:
    from recap.decoding import generate
    from recap.images import load_image
    from recap.models import load

    if not args.prompt.strip():
        raise InputError("the prompt is empty")
    image = load_image(args.image) if args.image else None
    proposer = _make_method(args)
    sampling = _sampling(args, args.seed)
    target = load(args.model, dtype=args.dtype, top_k=args.row_size, kernels=args.kernels, weights=args.weights)
    target.use_cost_profile(args.cost_profile)
    if image is not None and not target.accepts_images:
        raise InputError(f"{args.model} is a text-only model: it cannot take an image")
    _note_text_only(args, target)
    result = generate(target, args.prompt, image=image, method=proposer, max_new_tokens=args.max_new_tokens or 128,
                      **({"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                          "seed": sampling.seed} if sampling else {}))
    if args.memory:
        proposer.save_memory(args.memory)
    if args.json:
        print(json.dumps({
            "model": args.model, "method": args.method, "ablation": args.ablation, "dtype": args.dtype,
            "threads": torch.get_num_threads(),
            "text": result.text, "tokens": result.tokens, "prompt_tokens": result.prompt_len,
            "iterations": len(result.iterations), "tau": result.tau, "tokens_per_s": result.tokens_per_s,
            "stop_reason": result.stop_reason, "timings": result.timings(),
        }))
    else:
        print(result.text)
    return 0


def _overhead(args: argparse.Namespace) -> int:
    from recap.overhead import format_overhead, run_overhead

    if args.budget < 0:
        raise InputError(f"--budget cannot be negative, got {args.budget}")
    if args.method in ("decoy", "random"):
        raise InputError(f"{args.method} is a test drafter; time a real method (ar, recap or a baseline)")
    options = {"vocab": args.vocab, "requests": args.requests, "max_new_tokens": args.max_new_tokens or 128,
               "seed": args.seed, "budget": args.budget}
    result = run_overhead(args.method, **options)
    print(json.dumps(result) if args.json else format_overhead(result))
    return 0


def _check(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from recap.check import claims_exact, run_check
    from recap.models import load

    proposer = _make_method(args)
    sampling = _sampling(args, None)
    target = load(args.model, dtype=args.dtype, top_k=args.row_size, kernels=args.kernels, weights=args.weights)
    target.use_cost_profile(args.cost_profile)
    _note_text_only(args, target)
    if sampling is not None:
        return _check_sampling(args, target, proposer, sampling)
    exact = claims_exact(args.dtype, target.kernels)
    floats = None
    if target.weights == "stored":  # the claim: on the blocks, the float model's greedy output
        floats = load(args.model, dtype=args.dtype, top_k=args.row_size, kernels=args.kernels, weights="float")
        print(f"{args.method} reads {args.model}'s GGUF blocks as stored; reference: plain greedy decoding on its "
              "float weights")
    with Progress(transient=True) as progress:
        task = progress.add_task(f"{args.method} vs generate", total=args.prompts)

        def report(case):
            progress.advance(task)
            if not case.passed:
                progress.console.print(
                    f"{'MISMATCH' if exact else 'differs'} #{case.index} ({'image' if case.has_image else 'text'}) "
                    f"{case.prompt!r}: first difference at token {case.first_difference}; "
                    f"reference {case.reference[:12]}... output {case.output[:12]}...")

        check = run_check(target, proposer, prompts=args.prompts, max_new_tokens=args.max_new_tokens or 48,
                          vary=args.vary, seed=args.seed, on_case=report, reference=floats)
    cut = sum(case.cut_inside_path for case in check.cases)
    print(f"model {args.model}, method {args.method}, dtype {args.dtype}: mean tau {check.tau:.2f}, "
          f"{cut} stop(s) inside an accepted path")
    if not exact:
        print(f"agreement rate {check.agreement_rate:.1%} of prompts, {check.token_agreement_rate:.1%} of tokens "
              f"(bfloat16/float16 multi-token forwards may flip near-ties: reported, not claimed exact)")
    print(f"{check.passed} passed, {check.failed} failed")
    return 1 if exact and check.failed else 0


def _check_sampling(args: argparse.Namespace, target, proposer, sampling) -> int:
    """``check --temperature``: the distribution test of `recap.sampling_check` per prompt."""
    from rich.progress import Progress

    from recap.prompts import check_prompts
    from recap.sampling_check import check_sampling, exact_prefixes

    depth = 3 if sampling.top_k and sampling.top_k ** 3 <= 512 else 2
    passed = failed = 0
    with Progress(transient=True) as progress:
        task = progress.add_task(f"{args.method}: sampling distribution", total=args.prompts * args.samples)
        for index, (prompt, image) in enumerate(check_prompts(args.prompts, images=target.accepts_images)):
            inputs = target.prepare(prompt, image)
            table = exact_prefixes(target, inputs, sampling, depth)
            report = check_sampling(target, proposer, inputs, sampling, depth=depth, runs=args.samples,
                                    first_seed=args.seed + index * args.samples, probabilities=table,
                                    on_run=lambda: progress.advance(task))
            passed, failed = passed + report.passed, failed + (not report.passed)
            progress.console.print(
                f"#{index} {'ok' if report.passed else 'FAILED'} {prompt[:40]!r}: first {depth} tokens over "
                f"{report.cells} cells, p joint {report.p_joint:.3g}, per position "
                f"{', '.join(f'{p:.3g}' for p in report.p_positions)}; {report.accepted} draft tokens accepted")
    print(f"model {args.model}, method {args.method}, temperature {sampling.temperature}, top-k {sampling.top_k}, "
          f"top-p {sampling.top_p}: chi-square at alpha 0.001, {args.samples} samples per prompt")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


def _add_bench(commands) -> None:
    bench = commands.add_parser("bench", help="paired speed benchmark vs AR on MMSpec-format data: report and plots")
    bench.add_argument("--model", default="smollm2-135m",
                       help=f"built-in name ({', '.join(BUILTIN)}) or a local Hugging Face model folder")
    bench.add_argument("--methods", default=None,
                       help="comma-separated methods compared with ar (always run), options as NAME:key=value, "
                            "e.g. recap,pld,recap:budget=16 (default: those of recap,pld,token-recycling that exist)")
    bench.add_argument("--data", default="mmspec",
                       help="mmspec (../shared/data/mmspec), mmspec=PATH or PATH: a folder with mmspec.jsonl, or "
                            "the jsonl file")
    bench.add_argument("--topics", default=None, help="comma-separated topics (default: all), e.g. general-vqa")
    bench.add_argument("--limit", default="1", help="inputs per topic, or 'all' (default 1)")
    bench.add_argument("--dtype", choices=list(DTYPES), default="float32")
    bench.add_argument("--threads", type=_positive, default=1, help="torch CPU threads, pinned and recorded")
    bench.add_argument("--max-new-tokens", type=int, default=24)
    bench.add_argument("--seed", type=int, default=0, help="seeds the per-unit method order (and sampling seeds)")
    bench.add_argument("--repeats", type=_positive, default=1,
                       help="timed decodes of every (unit, method), in rounds from the same state; a row keeps its "
                            "median-time round (default 1)")
    _sampling_options(bench)
    bench.add_argument("--out", default="bench-out", help="output folder; a rerun resumes the run found there")
    bench.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up decode of each method")
    bench.add_argument("--report-only", action="store_true",
                       help="only rewrite summary.json, report.md and the plots from --out's results")
    bench.add_argument("--reference", choices=["stock", "float", "stock,float"], default=None,
                       help="stock: also run plain AR on stock transformers (row ar-stock); float: plain AR on "
                            "the float weights of a model read as GGUF blocks (row ar-float: its outputs must "
                            "equal AR's); paired in the same run")
    _cost_option(bench)
    _kernels_option(bench)


def _bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console

    from recap.bench import BenchConfig, run_bench
    from recap.bench.compiles import WARNING
    from recap.bench.report import load_run, write_outputs
    from recap.check import claims_exact

    console = Console(stderr=True)
    if args.report_only:
        rows, record = load_run(Path(args.out))
        for path in write_outputs(Path(args.out), rows, record):
            print(path)
        return 0
    if args.limit.strip().lower() == "all":
        limit = None
    else:
        try:
            limit = int(args.limit)
        except ValueError:
            raise InputError(f"--limit takes a whole number or 'all', got {args.limit!r}") from None
    topics = [t for t in args.topics.split(",") if t.strip()] if args.topics else None
    config = BenchConfig(model=args.model, methods=args.methods, data=args.data, topics=topics, limit=limit,
                         dtype=args.dtype, threads=args.threads, max_new_tokens=args.max_new_tokens,
                         seed=args.seed, repeats=args.repeats, out=Path(args.out), warmup=not args.no_warmup,
                         cost_profile=args.cost_profile, temperature=args.temperature or None, top_k=args.top_k,
                         top_p=args.top_p, kernels=args.kernels, weights=args.weights, reference=args.reference)
    if args.temperature:
        _sampling(args, 0)  # bad values are reported now, not at the first unit
    run = run_bench(config, console=console)
    if run.interrupted:
        print(f"recap: interrupted after {run.units_run} new unit(s); {args.out}/results.jsonl holds every finished "
              "unit; rerun the same command to resume", file=sys.stderr)
        return 130
    summary = run.summary
    for label, data in summary["methods"].items():
        if label != "ar":
            print(f"{label:>18}: S {data['S']:.2f}x  tau {data['tau']:.2f}  "
                  f"{data['mismatches']} mismatch(es) in {data['units']} units")
    for path in run.files:
        print(path)
    compiled = summary.get("compiled_units") or []
    if compiled:
        console.print("[bold yellow]warning[/]: " + WARNING.format(count=len(compiled),
                                                               seconds=sum(u["compile_s"] for u in compiled)))
    if summary["mismatches"]:
        console.print(f"[bold red]MISMATCH[/]: {summary['mismatches']} output(s) differ from AR; see "
                      f"{args.out}/report.md")
        return 1 if claims_exact(args.dtype, summary["run"].get("kernels", "stock")) else 0
    return 0


def _add_calibrate(commands) -> None:
    calibrate = commands.add_parser("calibrate", help="measure what verifying N tokens costs here (cost profile)")
    calibrate.add_argument("--model", required=True,
                           help=f"built-in name ({', '.join(BUILTIN)}) or a local Hugging Face model folder")
    calibrate.add_argument("--dtype", choices=list(DTYPES), default="float32")
    calibrate.add_argument("--threads", type=_positive, default=None,
                           help="torch CPU threads, pinned and recorded in the profile (default: torch's)")
    calibrate.add_argument("--device", default="cpu", help="torch device, e.g. cuda")
    calibrate.add_argument("--quick", action="store_true", help="fewer sizes and repeats (what auto measures)")
    calibrate.add_argument("--out", default=None, metavar="FILE", help="also write the profile to FILE")
    calibrate.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    _kernels_option(calibrate)


def _calibrate(args: argparse.Namespace) -> int:
    """Measure now, save to the cache (what `auto` then finds) and to --out."""
    import time

    from rich.progress import Progress

    from recap.models import load
    from recap.verifier.profile import measure_profile, profile_path, save_profile

    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        raise InputError(f"unknown --device {args.device!r}: {str(error).splitlines()[0]}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: this torch build or machine has no CUDA device")
    target = load(args.model, dtype=args.dtype, device=args.device, kernels=args.kernels, weights=args.weights)
    started = time.perf_counter()
    with Progress(transient=True, disable=args.json) as progress:
        task = progress.add_task(f"verify cost of {args.model}", total=None)
        profile = measure_profile(target, quick=args.quick,
                                  progress=lambda done, total: progress.update(task, completed=done, total=total))
    seconds = time.perf_counter() - started
    paths = [save_profile(profile, profile_path(profile.key))]
    if args.out:
        try:
            paths.append(save_profile(profile, args.out))
        except OSError as error:
            raise InputError(f"cannot write {args.out}: {error.strerror or error}") from None
    if args.json:
        print(json.dumps({"profile": profile.to_dict(), "seconds": seconds, "saved": [str(p) for p in paths]}))
        return 0
    key = profile.key
    gpu = f" {key['gpu']}" if key["gpu"] else ""
    print(f"verify cost of {args.model} ({key['dtype']}, {key.get('kernels', 'stock')} kernels, "
          f"{key['threads']} thread(s), {key['device']}{gpu}, "
          f"{key['cpu']}), measured in {seconds:.1f} s")
    contexts = [int(c) for c in profile.contexts]
    print(f"{'N':>5}" + "".join(f"{f'ms @L={c}':>13}{f'x1 @L={c}':>12}" for c in contexts))
    for s, n in enumerate(profile.sizes.astype(int)):
        row = profile.times[:, s]
        print(f"{n:>5}" + "".join(f"{t * 1e3:>13.2f}{t / profile.times[c, 0]:>11.2f}x" for c, t in enumerate(row)))
    for path in paths:
        print(f"saved {path}")
    return 0


def _add_demo_vlm_data(commands) -> None:
    data = commands.add_parser("demo-vlm-data", help="write held-out demo VLM scenes as MMSpec-format data for bench")
    data.add_argument("--out", required=True, metavar="DIR", help="folder to write mmspec.jsonl and images/ into")
    data.add_argument("--per-topic", type=_positive, default=2,
                      help="items per topic (captioning, shapes, charts, multi-turn; default 2)")


def _add_demo_vlm_memory(commands) -> None:
    from recap.demo_vlm.memory import MEMORY, REQUESTS

    memory = commands.add_parser("demo-vlm-memory",
                                 help="rebuild the demo VLM's RECAP memory of earlier requests (make demo's "
                                      "recap+memory column)")
    memory.add_argument("--requests", type=_positive, default=REQUESTS,
                        help=f"earlier requests on training-range scenes (default {REQUESTS})")
    memory.add_argument("--out", default=str(MEMORY), metavar="FILE",
                        help="where to save it (default: the shipped file)")
    memory.add_argument("--threads", type=_positive, default=None, help="torch CPU threads (default: torch's)")


def _demo_vlm_memory(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from recap.demo_vlm.memory import build_memory
    from recap.models import load

    start = time.perf_counter()
    target = load("recap-demo-vlm", dtype="float32")
    out = build_memory(target, Path(args.out), requests=args.requests)
    print(f"saved the memory of {args.requests} earlier requests to {out} "
          f"({out.stat().st_size / 1024:.0f} KiB, {time.perf_counter() - start:.0f} s)")
    return 0


def _add_serve(commands) -> None:
    serve = commands.add_parser("serve", help="an OpenAI-compatible chat-completions server (continuous batching)")
    serve.add_argument("--model", required=True,
                       help=f"built-in name ({', '.join(BUILTIN)}) or a local Hugging Face model folder")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; another address needs --api-keys)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--method", choices=[m for m in PROPOSERS if m not in ("decoy", "random")], default="recap")
    serve.add_argument("--dtype", choices=list(DTYPES), default="float32")
    serve.add_argument("--threads", type=_positive, default=None, help="torch CPU threads (default: torch's)")
    _kernels_option(serve)
    serve.add_argument("--memory-dir", default=None, metavar="DIR",
                       help="keep each tenant's drafting memory in DIR/<tenant>.safetensors across restarts")
    serve.add_argument("--memory-rows", type=_positive, default=16384,
                       help="bound of each tenant's RECAP token memory in rows (least recently seen go first)")
    serve.add_argument("--api-keys", default=None, metavar="FILE",
                       help="one '<tenant> <key>' per line; clients send 'Authorization: Bearer <key>'")
    serve.add_argument("--max-queue", type=_positive, default=64,
                       help="requests admitted and not yet decoding before answering 429")
    serve.add_argument("--tenant-share", type=float, default=0.5,
                       help="with several tenants (--api-keys), the share of the request slots (queue plus batch "
                            "lanes) one tenant may hold at once; past it that tenant gets 429 while the others "
                            "are still admitted (default 0.5; 1: no limit)")
    serve.add_argument("--max-batch", type=_positive, default=None,
                       help="requests decoded together, one forward per step (default: on the fast kernels, "
                            "the most whose one-row-each step costs at most 2x a one-token step on this "
                            "machine's cost profile; 1 on stock)")
    serve.add_argument("--batch-budget", choices=["shared", "each"], default="shared",
                       help="shared: cost-aware drafters share each step's verification budget by expected gain; "
                            "each: every request sizes its own tree as it would alone")
    serve.add_argument("--max-tokens-limit", type=_positive, default=1024, help="largest max_tokens a request may ask")
    serve.add_argument("--request-timeout", type=_positive, default=300, help="seconds a request may take in all")
    serve.add_argument("--prepare-timeout", type=_positive, default=30, metavar="SECONDS",
                       help="seconds a request may wait for and spend in preparation (parse, image, tokens, vision "
                            "tower; one request at a time) before a 503 prepare_timeout (default 30)")
    serve.add_argument("--max-connections", type=_positive, default=256,
                       help="open connections (and requests in progress) past which uvicorn answers 503 "
                            "(default 256)")
    serve.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                       help="after SIGTERM, seconds the running requests get to finish before they end with a "
                            "503 event (waiting and new requests get 503 at once; default 30)")
    serve.add_argument("--header-timeout", type=float, default=10.0,
                       help="seconds a client has to send a request's headers before its connection is closed "
                            "(default 10)")
    serve.add_argument("--max-body-bytes", type=_positive, default=16 * 1024 * 1024, metavar="N",
                       help="largest request body, counted as it streams in (default 16 MiB)")
    serve.add_argument("--max-image-bytes", type=_positive, default=10 * 1024 * 1024, metavar="N",
                       help="largest image file (default 10 MiB)")
    serve.add_argument("--max-image-pixels", type=_positive, default=40_000_000, metavar="N",
                       help="largest image in pixels, checked before decoding (default 40000000)")
    serve.add_argument("--max-image-tokens", type=_positive, default=4096, metavar="N",
                       help="most image tokens one image may become (counted after the processor, before the vision "
                            "tower): past it 400 image_too_large (default 4096)")
    serve.add_argument("--allow-local-images", default=None, metavar="DIR",
                       help="accept image_url parts that are paths of files under DIR (symlinks and '..' resolved; "
                            "default: base64 data: URLs only)")
    serve.add_argument("--replicas", type=_positive, default=None, metavar="N",
                       help="decode on N replicas on Ray (a private local instance on 127.0.0.1 unless "
                            "--ray-address); tenants share --memory-dir through file locks; needs "
                            "recap-decoding[ray]")
    serve.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="start the replicas on the running Ray cluster at ADDR (e.g. 10.0.0.1:6379 or auto); "
                            "default replicas: 1")
    serve.add_argument("--replica-cpus", type=float, default=None, metavar="N",
                       help="CPUs each replica asks Ray for (default: --threads, else 1)")
    _cost_option(serve)


def _serve(args: argparse.Namespace) -> int:
    import ipaddress
    import logging
    import signal

    import uvicorn

    from recap.models import load
    from recap.serve import ServerConfig, create_app
    from recap.serve.http import DrainingServer, header_deadline_protocol
    from recap.serve.tenants import read_api_keys

    keys = read_api_keys(args.api_keys) if args.api_keys else None
    try:
        loopback = args.host == "localhost" or ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = False
    if args.allow_local_images is not None and keys is None and not loopback:
        raise InputError(f"--allow-local-images on --host {args.host} would let other machines read images from "
                         f"{args.allow_local_images}: give --api-keys FILE, or serve on 127.0.0.1")
    if keys is None and not loopback:
        raise InputError(f"--host {args.host} is reachable from other machines: give --api-keys FILE, or serve on "
                         "127.0.0.1")
    if not args.shutdown_grace >= 0:
        raise InputError(f"--shutdown-grace must be 0 or more, got {args.shutdown_grace}")
    if not args.header_timeout > 0:
        raise InputError(f"--header-timeout must be positive, got {args.header_timeout}")
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must be in 0-65535, got {args.port}")
    if args.allow_local_images is not None and not os.path.isdir(args.allow_local_images):
        raise InputError(f"--allow-local-images {args.allow_local_images}: not a folder (it takes the folder "
                         "images may be read from)")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    target = load(args.model, dtype=args.dtype, kernels=args.kernels, weights=args.weights)
    target.use_cost_profile(args.cost_profile)
    name = args.model if args.model in BUILTIN else os.path.basename(os.path.normpath(args.model))
    config = ServerConfig(model_name=name, method=args.method, api_keys=keys, memory_dir=args.memory_dir,
                          memory_rows=args.memory_rows,
                          max_queue=args.max_queue, max_batch=args.max_batch, tenant_share=args.tenant_share,
                          shared_budget=args.batch_budget == "shared", max_tokens_limit=args.max_tokens_limit,
                          request_timeout=float(args.request_timeout), prepare_timeout=float(args.prepare_timeout),
                          max_body_bytes=args.max_body_bytes,
                          max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
                          max_image_tokens=args.max_image_tokens,
                          allow_local_images=args.allow_local_images)
    make_engine, where = None, f"{torch.get_num_threads()} thread(s)"
    if args.replicas is not None or args.ray_address is not None:
        make_engine = _scaled_engine(args)
        where = f"{args.replicas or 1} replica(s) on Ray"
    app = create_app(target, config, make_engine)
    print(f"serving {name} with {args.method} on http://{args.host}:{args.port} ({where}; "
          f"{'tenants from ' + args.api_keys if keys else 'one tenant, no keys'})", flush=True)
    # On SIGTERM the engine drains first (waiting requests 503, running ones --shutdown-grace seconds, then
    # a 503 event), uvicorn closes the connections, the memories are saved; uvicorn then raises the signal
    # again for the previous handler: a no-op one here, so the exit status is 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                           http=header_deadline_protocol(args.header_timeout),
                                           limit_concurrency=args.max_connections),
                            app.state.engine.drain, grace=args.shutdown_grace)
    server.run()
    return 0


def _scaled_engine(args: argparse.Namespace):
    """``--replicas`` / ``--ray-address``: start the replicas (the only place Ray is imported)."""
    try:
        from recap.serve.scale import ReplicaSpec, scaled_engine_factory
    except ImportError as error:
        raise InputError(f"--replicas and --ray-address need Ray ({error.msg}): pip install "
                         "'recap-decoding[ray]'") from None
    if args.replica_cpus is not None and not args.replica_cpus > 0:
        raise InputError(f"--replica-cpus must be positive, got {args.replica_cpus}")

    def absolute(path: str | None) -> str | None:  # replicas do not share this process's folder
        return os.path.abspath(path) if path is not None and os.path.exists(path) else path

    model = args.model if args.model in BUILTIN else absolute(args.model)
    profile = args.cost_profile if args.cost_profile in ("auto", "flat") else absolute(args.cost_profile)
    memory = os.path.abspath(args.memory_dir) if args.memory_dir is not None else None
    spec = ReplicaSpec(model=model, dtype=args.dtype, kernels=args.kernels, weights=args.weights,
                       cost_profile=profile,
                       threads=args.threads, method=args.method, memory_dir=memory, memory_rows=args.memory_rows,
                       max_queue=args.max_queue, max_batch=args.max_batch,
                       shared_budget=args.batch_budget == "shared")
    return scaled_engine_factory(spec, args.replicas or 1, address=args.ray_address,
                                 cpus_per_replica=args.replica_cpus or args.threads or 1)


def _demo_vlm_data(args: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    from recap.bench.data import DATA_FILE, load_items, units_of
    from recap.demo_vlm.bench_data import write_scene_benchmark

    out = write_scene_benchmark(Path(args.out), per_topic=args.per_topic)
    items = load_items(out / DATA_FILE)
    topics = ", ".join(dict.fromkeys(item.topic for item in items))
    print(f"wrote {len(items)} items ({len(units_of(items))} units; topics {topics}) to {out}")
    print(f"next: recap bench --model recap-demo-vlm --data {shlex.quote(str(out))} --limit all --max-new-tokens 64")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
