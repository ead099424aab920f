# flair-fabric: every target installs what it needs first, so `make test` and `make demo` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of PyTorch: it lies on local disk on this kind of machine; a bare `torch` would pull a CUDA build.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test test-fast demo demo-lm bench lint clean mutation-check gpu-check gpu-check-dry

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_PIN)"
	$(BIN)/pip install --quiet -e ".[dev,demo]" "$(TORCH_PIN)"
	touch $(STAMP)

# Three pytest-xdist workers: the tests' own processes (imports, waits for engines and timeouts) leave a 2-core
# machine idle a third of the time on two (docs/testing.md).
PYTEST := HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/pytest -q -n 3 --dist worksteal

test: $(STAMP)
	$(PYTEST)

test-fast: $(STAMP)
	$(PYTEST) -m "not multiprocess"

demo: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python examples/demo_trec.py

demo-lm: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python examples/language_model/demo_lm.py

bench: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python benchmarks/run.py

# The GPU check (docs/gpu-check.md). On a CUDA machine without network: PYTHON is the interpreter that holds torch
# there; the wheels in .whl/ (benchmarks/gpu_wheels.sh fetches them where PyPI is reachable) are installed into
# /tmp/site and flair_fabric is read from this working tree. Without CUDA it exits at once with code 2.
gpu-check:
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PYTHON) benchmarks/gpu_check.py $(if $(wildcard .whl/*.whl),--install-wheels)

gpu-check-dry: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python benchmarks/gpu_check.py --dry --out runs/gpu-check-dry

mutation-check: $(STAMP)
	$(BIN)/python tests/mutation_check.py

lint: $(STAMP)
	$(BIN)/ruff check flair_fabric tests benchmarks examples
	$(BIN)/ruff format --check flair_fabric tests benchmarks examples
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache runs
