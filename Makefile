# The README's two commands, `make run` and `make test`, do the whole set-up.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A bare `torch` pulls a CUDA build of several GB; this pin takes the local CPU build.
TORCH_SPEC ?= torch==2.13.0
TRACE ?= ../shared/traces/conversation_trace.jsonl

.PHONY: install test run check lint bench clean

$(BIN)/tiering:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev]"

install: $(BIN)/tiering

test: install
	$(BIN)/python -m pytest -q

run: install
	@if [ -f "$(TRACE)" ]; then \
		$(BIN)/tiering simulate --trace "$(TRACE)" --capacity-tokens 1000000,3000000,10000000 --policy lru,arc; \
	else \
		echo "no trace at $(TRACE); running the built-in chat workload"; \
		$(BIN)/tiering simulate --workload chat --capacity-tokens 1000000,3000000,10000000 --policy lru,arc; \
	fi

check: install
	$(BIN)/ruff format --check tiering tests bench
	$(BIN)/ruff check tiering tests bench
	$(BIN)/mypy --strict tiering

lint: install
	$(BIN)/ruff format tiering tests bench
	$(BIN)/ruff check --fix tiering tests bench

bench: install
	$(BIN)/python bench/manager.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
