# The README's two commands, `make run` and `make test`, do the whole set-up.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A bare `torch` pulls a CUDA build of several GB; this pin takes the local CPU build.
TORCH_SPEC ?= torch==2.13.0
TRACE ?= ../shared/traces/conversation_trace.jsonl

.PHONY: install test test-vllm vllm-env run check lint bench dashboards plots gpu-wheels dist clean

$(BIN)/tiering:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev]"

install: $(BIN)/tiering

# The vLLM tests run in a second pytest, with vLLM's sources on PYTHONPATH (for them only).
test: install
	$(BIN)/python -m pytest -q --ignore=tests/vllm
	$(MAKE) --no-print-directory test-vllm

# vLLM 0.33.0's pure-Python sources and what they import, in $(VLLM_ENV)/site (not the venv).
VLLM_ENV ?= .vllm-env
VLLM_SITE := $(VLLM_ENV)/site
$(VLLM_SITE)/.complete: scripts/vllm_env.sh | $(BIN)/tiering
	scripts/vllm_env.sh $(VENV) $(VLLM_ENV)

vllm-env: install $(VLLM_SITE)/.complete

test-vllm: vllm-env
	PYTHONPATH=$(VLLM_SITE) VLLM_TARGET_DEVICE=cpu TIERING_REQUIRE_VLLM=1 \
		$(BIN)/python -m pytest -q tests/vllm

run: install
	@if [ -f "$(TRACE)" ]; then src="--trace $(TRACE)"; else \
		echo "no trace at $(TRACE); using the built-in chat workload"; src="--workload chat"; fi; \
	echo "== tiering simulate: hit rate per policy and CPU tier size, every request one at a time (no bytes moved)"; \
	$(BIN)/tiering simulate $$src --capacity-tokens 1000000,3000000,10000000 --policy all && \
	echo && echo "== tiering replay: the engine moving real bytes, verified: the first 2000 requests only, 4 at once" && \
	echo "   (a colder tier than simulate's over every request: a lower hit rate at 3000000 tokens)" && \
	$(BIN)/tiering replay $$src --requests 2000 --capacity-tokens 3000000 --verify && \
	echo && echo "== to run tiering yourself, activate the venv (or call $(BIN)/tiering):" && \
	echo "   source $(VENV)/bin/activate"

check: install
	$(BIN)/ruff format --check tiering tests bench
	$(BIN)/ruff check tiering tests bench
	$(BIN)/mypy --strict tiering

lint: install
	$(BIN)/ruff format tiering tests bench
	$(BIN)/ruff check --fix tiering tests bench

# Every benchmark runs, whatever an earlier one missed; the missed ones are named at the end.
BENCHES = manager policy first_reuse transfer engine events remote concurrency disk

bench: install
	@missed=""; for name in $(BENCHES); do \
		echo "== bench/$$name.py"; $(BIN)/python bench/$$name.py || missed="$$missed $$name"; \
	done; \
	if [ -n "$$missed" ]; then echo "benchmarks that missed a target:$$missed" >&2; exit 1; fi

# Regenerate dashboards/tiering.json; check and unit-test the alert rules where promtool is.
dashboards: install
	$(BIN)/python dashboards/generate.py
	@if command -v promtool >/dev/null 2>&1; then \
		promtool check rules dashboards/alerts.yml && promtool test rules dashboards/alerts_test.yml; \
	else echo "promtool not found (apt-get install prometheus): alert rules not checked"; fi

# The README's figures, docs/policies.png and docs/disk-tiers.png (tracked), from the
# conversation trace: the README's own plot commands write elsewhere, never over these.
plots: install
	@if [ ! -f "$(TRACE)" ]; then echo "no trace at $(TRACE): the README's figures are of it" >&2; exit 1; fi
	$(BIN)/tiering simulate --trace $(TRACE) --policy all \
		--capacity-tokens 500000,1000000,3000000,10000000,20000000 --plot docs/policies.png
	$(BIN)/tiering simulate --trace $(TRACE) --policy lru,aslru --capacity-tokens 3000000 \
		--disk-tokens 10000000,30000000,100000000 --plot docs/disk-tiers.png

# Wheels of what the GPU check needs and the device image lacks (scripts/gpu_check.sh
# says which: msgspec), for its Python (3.12) on x86_64 Linux, into wheels/ (ignored), which a
# device call carries: the device has no network.
GPU_WHEELS ?= msgspec>=0.18.6
GPU_PYTHON ?= 3.12
gpu-wheels: install
	$(BIN)/pip download --quiet --only-binary=:all: --python-version $(GPU_PYTHON) \
		--implementation cp --abi cp$(subst .,,$(GPU_PYTHON)) \
		--platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
		-d wheels $(foreach w,$(GPU_WHEELS),"$(w)")
	@ls wheels

# The wheel, dist/tiering-VERSION-py3-none-any.whl, to install where vLLM runs (README,
# "Use it from vLLM"). build/ goes first: setuptools would pack a module deleted since.
dist: install
	rm -rf build dist/tiering-*.whl
	$(BIN)/pip wheel --quiet --no-deps -w dist .
	@ls dist/tiering-*.whl

clean:
	rm -rf $(VENV) $(VLLM_ENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
