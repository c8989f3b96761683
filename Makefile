# kvrelay — the two quick-start commands are `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= qwen2.5-coder-0.5b
OUT ?= out/demo
export PYTHONUNBUFFERED := 1

.PHONY: demo test test-data lint setup clean bench-relay

$(BIN)/python:
	$(PY) -m venv $(VENV)

# Re-install when the project metadata changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

# The main job: one relay (kv vs text), the relay and pipeline benchmarks, a short audit with its report.
demo: setup
	$(BIN)/kvrelay models pull $(MODEL)
	$(BIN)/kvrelay relay --model $(MODEL) --context docs/demo/context.md \
		--question "Which function in the report has the bug, and what is the fix? Answer in one sentence." \
		--json $(OUT)/relay.json
	$(BIN)/kvrelay bench relay --model $(MODEL) --context-tokens 512,2048 --repeats 3 --json $(OUT)/bench_relay.json
	$(BIN)/kvrelay bench pipeline --workflow review3 --model $(MODEL) --context-tokens 1024 --repeats 1 \
		--json $(OUT)/pipeline_review3.json
	$(BIN)/kvrelay audit --preset quick --model $(MODEL) --limit 12 --out $(OUT)/audit
	@echo "audit report: $(abspath $(OUT)/audit/report.html)"

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports

# Data and models the network/integration tests read, fetched once before pytest (no test downloads mid-run).
test-data: setup
	$(BIN)/python -m tests.prefetch

test: setup lint test-data
	$(BIN)/python -m pytest -q -ra

bench-relay: setup
	$(BIN)/kvrelay bench relay --model $(MODEL) --context-tokens 512,2048 --repeats 5 --json docs/bench/relay_$(MODEL).json

clean:
	rm -rf $(VENV) out .pytest_cache
