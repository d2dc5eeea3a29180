# One command each: `make train` sets up and trains the default experiment; `make test` sets up and runs the tests.
# Extra Hydra arguments: make train ARGS="trainer=ddp model/size=small"
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first and pinned: 2.13.0 is a local CPU wheel on the CI machines. On a GPU machine
# use the CUDA build: make setup TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH ?= torch==2.13.0
# The tested versions of every package (pip constraints, docs/install.md). LOCK= installs the newest
# releases that pyproject.toml allows instead.
LOCK ?= requirements.lock
CONSTRAINTS := $(if $(LOCK),-c $(LOCK))
# What installs the packages after torch: uv (`uv pip install`, the same constraints; 7 s against pip's 42 s for the
# lock on a 2-core CI machine, docs/install.md), itself pip-installed into the venv first. torch is pip's either way:
# pip reads pip.conf and TORCH's --index-url (a local CPU wheel, a CUDA build), uv reads only its own settings
# (UV_INDEX_URL, uv.toml). INSTALLER=pip installs everything with pip.
INSTALLER ?= uv
INSTALL := $(if $(filter uv,$(INSTALLER)),$(VENV)/bin/uv pip install -q --python $(PY),$(PY) -m pip install -q --no-compile)

.PHONY: setup train test test-fast test-gpu test-cluster test-latest lock flake-check lint clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(LOCK)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --no-compile $(TORCH) $(CONSTRAINTS)
	$(if $(filter uv,$(INSTALLER)),$(PY) -m pip install -q --no-compile uv $(CONSTRAINTS))
	$(INSTALL) $(CONSTRAINTS) -e ".[dev]"
	# litdata (data=litdata) without its declared deps: its torchvision requirement would replace torch (pyproject.toml)
	$(INSTALL) $(CONSTRAINTS) --no-deps "litdata>=0.2.76"
	# The bytecode pip would write one file at a time, on every core instead (a shorter install; docs/performance.md).
	# A file that does not compile under this Python (torch ships one in 3.12 syntax) stays source, as pip leaves it.
	# The packages' own test suites (pandas', sympy's, scipy's...: nothing imports them) are left out: 26 s against 41.
	$(PY) -m compileall -q -j 0 -x '/tests?/' "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
	touch $@

train: setup
	$(PY) train.py $(ARGS)

# Tests run in TEST_WORKERS pytest-xdist processes (TEST_WORKERS=0: one process). Most of a slow test's time is
# one core busy (a process importing torch and Lightning) or none (a rank waiting for a collective or a timeout),
# so more workers than cores pays on small machines (docs/performance.md, "Test suite time").
TEST_WORKERS ?= 3
test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=15 $(ARGS)  # the 15 slowest: the suite's 10-minute budget (docs/testing.md)

# The GPU lane (tests/test_gpu.py): on a machine with CUDA, in the Python that has the CUDA build of torch
# and the project installed (GPU_PYTHON; a device machine reaches no registry, so it is not `make setup`'s venv).
# GPU_LANE_ON_CPU=1 make test-gpu rehearses it here: the tests' own code, with the CPU as the device (~40 s)
GPU_PYTHON ?= $(PY)
test-gpu:
	$(GPU_PYTHON) -m pytest -m gpu -p no:cacheprovider -n 0 -rs tests/test_gpu.py $(ARGS)

# ruff's lint and format checks (pyproject.toml [tool.ruff]); `ruff check --fix . && ruff format .` repairs most
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test-fast: setup  # everything except the multi-process / end-to-end runs
	$(PY) -m pytest -m "not slow" $(ARGS)

# The tests marked `cluster` against a real one-node SLURM cluster (docs/clusters.md): installs slurm-wlm and munge
# with apt-get if missing (needs root), starts munged, slurmctld and slurmd with their files in /tmp/slurm-test-<id>,
# waits for the node, runs the tests, then stops the daemons it started. Without root or apt the tests skip, saying why.
test-cluster: setup
	tests/helpers/slurm_cluster.sh run $(PY) -m pytest -m cluster -rsP --durations=0 $(ARGS)

# The newest releases pyproject.toml allows, torch included, in a venv of their own made anew each time, against the
# fast tests: run it before `make lock` to see what a new release breaks before a user installing without the lock
# does. torch newer than 2.13.0 is a CUDA build from PyPI on a CPU machine (2.14.1: ~6 GB, ~1.5 min here;
# docs/install.md); a release beyond pyproject.toml's range is named before the tests (scripts/newest_torch.py).
TORCH_RANGE = $(shell sed -nE 's/^ *"torch([<>=!~,.0-9]*)".*/\1/p' pyproject.toml)
test-latest:
	rm -rf .venv-latest
	$(MAKE) setup VENV=.venv-latest LOCK= TORCH="'torch$(TORCH_RANGE)'"
	.venv-latest/bin/python -m pip install -q --dry-run --no-deps --ignore-installed --report .venv-latest/torch.json torch
	.venv-latest/bin/python scripts/newest_torch.py .venv-latest/torch.json
	.venv-latest/bin/python -m pytest -m "not slow" -n $(TEST_WORKERS) $(ARGS)

# Refresh requirements.lock: install the newest allowed releases into a scratch venv and freeze what was installed
# (torch without its local build tag, so the CUDA builds of the same version satisfy it too).
# The routine: make test-latest; make lock; make test; commit requirements.lock.
lock:
	rm -rf .venv-lock
	$(MAKE) setup VENV=.venv-lock LOCK=
	{ echo "# The tested versions: pip constraints frozen by 'make lock' (Makefile) on Linux x86_64, CPython $$(.venv-lock/bin/python -c 'import platform; print(platform.python_version())')."; \
	  echo "# Used by 'make setup' as pip install -c requirements.lock; LOCK= installs without it."; \
	  .venv-lock/bin/python -m pip freeze --exclude-editable | sed -E 's/^(torch==[^+]+)\+.*/\1/'; } > requirements.lock.tmp
	mv requirements.lock.tmp requirements.lock
	rm -rf .venv-lock

# Every multi-process / end-to-end test (marked slow) FLAKE_RUNS times; prints each test's failures.
FLAKE_RUNS ?= 20
flake-check: setup
	$(PY) tests/helpers/flake_check.py --runs $(FLAKE_RUNS) -- -m slow -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

clean:  # generated outputs only; keeps the environment
	rm -rf logs .cache .pytest_cache
