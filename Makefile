# Every target creates (or reuses) .venv and installs what it needs first.
# torch is installed before anything else and pinned, so no CUDA wheels are pulled
# on a CPU machine; override with e.g. `make test TORCH_SPEC="torch==2.5.1"`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dkfac-installed

.PHONY: install demo test test-slow lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# SGD vs SGD+K-FAC (dkfac strategy) on the bundled digits with 2 local workers.
# Damping 0.03 rather than the library's 0.003: on this small CNN the lower damping drives the
# training loss to 0 and the test loss up (97% accuracy); 0.03 reaches 95% an epoch before SGD
# and ends above it (98.9% vs 98.4%, measured 2026-11-22).
demo: $(STAMP)
	$(VENV)/bin/dkfac compare --nproc 2 --damping 0.03 --out runs/demo

# The suite a developer runs (under 10 minutes on 2 cores); test-slow adds the end-to-end
# benchmark runs and the extra strategy variants; CI runs both.
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/step_overhead.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
