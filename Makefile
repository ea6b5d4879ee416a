# Every install step lives here: `make test` on a fresh machine creates .venv and installs .[test].
# `make demo` uses the same .venv but installs only the runtime dependencies and the server's (`pip install -e .[serve]`:
# no torch, no transformers); a later `make test` adds the test extras on top, and a demo after `make test` reuses them.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-test
RUNTIME_STAMP := $(VENV)/.installed-runtime
DEMO_PROMPT ?= sort 3 1 4 1 5 9 2 6
DEMO_FLAGS ?= --show-steps

.PHONY: test venv agent-clis demo demo-train bench bench-load bench-serving clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch==2.13.0 (CPU build) is pinned in the test extra; reinstall when pyproject changes.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[test,serve]"
	touch $(STAMP)

# Runtime dependencies (jax, flax, tokenizers, jinja2, ...) and the server's (fastapi, uvicorn), for the demo and the CLI.
$(RUNTIME_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[serve]"
	touch $(RUNTIME_STAMP)

# The TPU and GPU compilers of the `aot` extra, beside the environment (docs/compiling.md).
COMPILERS_STAMP := $(VENV)/clover-jax-compilers/.clover-jax-compilers.json
$(COMPILERS_STAMP): $(STAMP)
	$(BIN)/python -m clover_jax.parallel.compilers install --quiet

venv: $(STAMP) $(COMPILERS_STAMP)

# Codex CLI and Claude Code, pinned, for the tests that run them against the server
# (tests/clover_jax/api/serving/test_agent_clis.py; docs/serving.md, Agents). npm's own wrappers land in
# $(AGENT_CLIS)/node_modules/.bin; Codex's npm package brings its native binary for this platform. The stamp
# names both versions, so that a new pin installs again.
CODEX_VERSION := 0.171.0
CLAUDE_CODE_VERSION := 2.0.77
AGENT_CLIS := $(VENV)/agent-clis
AGENT_CLIS_STAMP := $(AGENT_CLIS)/.installed-codex-$(CODEX_VERSION)-claude-code-$(CLAUDE_CODE_VERSION)
$(AGENT_CLIS_STAMP): | $(BIN)/python
	@command -v npm >/dev/null || { echo "make: npm (Node.js 18 or later) installs the agent CLIs the tests run"; exit 1; }
	rm -f $(AGENT_CLIS)/.installed-*
	npm install --prefix $(AGENT_CLIS) --save-exact --no-audit --no-fund --loglevel=error \
		@openai/codex@$(CODEX_VERSION) @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION)
	touch $(AGENT_CLIS_STAMP)

agent-clis: $(AGENT_CLIS_STAMP)

# One pytest worker per core (2 on CI); each test file runs whole on one worker, so its module fixtures are built once.
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)

test: $(STAMP) $(COMPILERS_STAMP) $(AGENT_CLIS_STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The bundled tiny Clover (clover_jax/bundled/tiny-clover, trained to sort digits) answering from the command
# line, each block shown as it is denoised: first with its shipped decoding controls, then two positions per
# step. Override DEMO_PROMPT / DEMO_FLAGS to try other prompts and controls.
demo: $(RUNTIME_STAMP)
	@echo "== shipped controls: LowConfidence decoding, block size and threshold from generation_config.json"
	$(BIN)/clover-jax generate $(DEMO_FLAGS) "$(DEMO_PROMPT)"
	@echo "== the fixed_k schedule, two positions per denoising step: watch each block fill in"
	$(BIN)/clover-jax generate $(DEMO_FLAGS) --schedule fixed_k --tokens-per-step 2 "$(DEMO_PROMPT)"

# Clover's own story in miniature (docs/training.md): the bundled autoregressive base
# (clover_jax/bundled/tiny-qwen-base) converted into a Clover by `clover-jax train`, then scored on
# held-out prompts by diffusion and autoregressively. DATA=FILE.jsonl trains on your chat JSONL
# instead of the task's; OUT=DIR is where the Clover is written.
DATA ?=
OUT ?= build/demo-clover
TRAIN_STAMP := $(VENV)/.installed-train

$(TRAIN_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[serve,train]"
	touch $(TRAIN_STAMP)

demo-train: $(TRAIN_STAMP)
	$(BIN)/python scripts/demo_train.py --out "$(OUT)" $(if $(DATA),--data "$(DATA)")

# Every benchmark side by side (about 1.5 hours on 2 cores); rewrites docs/benchmarks.md.
bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

bench-load: $(STAMP)
	$(BIN)/python benchmarks/load.py

# The serving engine at concurrency 1/4/16 against `generate` one request at a time (docs/serving.md); JSON on stdout.
bench-serving: $(STAMP)
	$(BIN)/python benchmarks/serving.py

clean:
	rm -rf $(VENV) build *.egg-info
