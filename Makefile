# Every target creates (or reuses) .venv and installs what it needs first.
# torch is installed before anything else and pinned, so no CUDA wheels are pulled
# on a CPU machine; override with e.g. `make test TORCH_SPEC="torch==2.5.1"`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dkfac-installed

.PHONY: install demo test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# SGD vs SGD+K-FAC (dkfac strategy) on the bundled digits with 2 local workers.
demo: $(STAMP)
	$(VENV)/bin/dkfac compare --nproc 2 --out runs/demo

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/step_overhead.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
