# One command each: `make train` sets up and trains the default experiment; `make test` sets up and runs the tests.
# Extra Hydra arguments: make train ARGS="trainer=ddp model/size=small"
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first and pinned: 2.13.0 is a local CPU wheel on the CI machines. On a GPU machine
# use the CUDA build: make setup TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH ?= torch==2.13.0

.PHONY: setup train test test-fast clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	# litdata (data=litdata) without its declared deps: its torchvision requirement would replace torch (pyproject.toml)
	$(PY) -m pip install -q --no-deps "litdata>=0.2.76"
	touch $@

train: setup
	$(PY) train.py $(ARGS)

# Tests run in TEST_WORKERS pytest-xdist processes (TEST_WORKERS=0: one process). Most of a slow test's time is
# one core busy (a process importing torch and Lightning) or none (a rank waiting for a collective or a timeout),
# so more workers than cores pays on small machines (docs/performance.md, "Test suite time").
TEST_WORKERS ?= 3
test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

test-fast: setup  # everything except the multi-process / end-to-end runs
	$(PY) -m pytest -m "not slow" $(ARGS)

clean:  # generated outputs only; keeps the environment
	rm -rf logs .cache .pytest_cache
