# Every target creates (or reuses) .venv and installs what it needs first.
# torch is installed before anything else and pinned (on these machines a local CPU wheel
# serves it; from PyPI it is a CUDA build, which runs on a CPU too); override with e.g.
# `make test TORCH_SPEC="torch==2.5.1" VENV=.venv-torch2.5.1`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dkfac-installed

.PHONY: install demo test test-slow test-compat lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# SGD vs adaptive K-FAC (dkfac strategy, the optimizer moving nothing else: every layer of the
# CNN is K-FAC's) on the bundled digits with 2 local workers, full batch (672 per worker, one
# step per epoch), K-FAC as dkfac.fast_to_target configures it (--recipe). Seeds 0-2,
# 2026-11-27 (sixteenth session): K-FAC at 97% test accuracy in 0.37-0.46 s (7-8 steps), SGD
# at rate 0.05 in 1.9-2.3 s (66-88); README "Two commands".
demo: $(STAMP)
	$(VENV)/bin/dkfac compare --nproc 2 --batch-size 672 --epochs 100 --lr 0.05 \
		--recipe fast_to_target --schedule constant --weight-decay 0 --target-accuracy 0.97 \
		--out runs/demo

# The suite a developer runs, on TEST_WORKERS processes (pytest-xdist; tests/conftest.py
# gives each one intra-op thread). 2026-11-29, 2 cores: 7 min 20 s on 2 processes, 10 min
# 16 s on one: a third of the serial run's core time was idle (single-process tests leave a
# core free; a distributed test waits on its workers' start, timeouts and subprocesses).
# test-slow adds the end-to-end benchmark runs and the extra strategy variants, one test at a
# time; CI runs both.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist worksteal --durations=15

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# The developer's suite again on another torch, in its own environment (torch from PyPI: a
# CUDA build with its libraries, about 3 GB, which runs on the CPU too). Below 2.13 dkfac
# compiles its hooks another way (deferred_statistics.TENSOR_HOOKS_SHARE_BUFFERS), and the
# GPU machines run 2.11, so CI runs that path on 2.11.
COMPAT_TORCH ?= 2.11.0
test-compat:
	$(MAKE) test VENV=.venv-torch$(COMPAT_TORCH) TORCH_SPEC="torch==$(COMPAT_TORCH)"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/step_overhead.py

clean:
	rm -rf $(VENV) .venv-torch* build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
