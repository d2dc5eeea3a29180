"""Shared helpers: compose configs in-process, run train.py / eval.py as real subprocesses, read TensorBoard."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SHARED_DATA") or ROOT.parent / "shared" / "data")  # SHARED_DATA: the GPU lane's copy
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub requests from tests: fail fast instead of retrying
# One torch thread per process: in the test processes and in every run they start (which inherit it). `make test`
# runs 3 pytest-xdist workers on 2 cores; a 1-process run taking both cores (torch's default) beside the others
# oversubscribes them, and OpenMP's spin-waits made such runs 2-6x slower (docs/performance.md, "Test suite time").
# Lightning's launcher keeps a set OMP_NUM_THREADS for its ranks; test_train checks the cap of a larger one.
os.environ["OMP_NUM_THREADS"] = "1"

import src.launch.resolvers  # noqa: E402,F401
from src.utils.config import register_schemas  # noqa: E402
from tests.helpers import forkrun  # noqa: E402

register_schemas()

# Small and quick: a test run must prove behaviour, not train a good model.
FAST = [
    "extras.print_config=false",
    "trainer.max_steps=20",
    "trainer.val_check_interval=10",
    "trainer.limit_val_batches=4",
    "trainer.limit_test_batches=4",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_progress_bar=false",
    "callbacks.throughput.window_size=5",
    "callbacks.generate_text.max_new_tokens=8",
    "data.global_batch_size=8",
    "data.seq_len=64",
    "model.n_layer=2",
]


def shared(*parts: str) -> Path:
    path = SHARED.joinpath(*parts)
    if not path.exists():
        # at a module's top (test_vocab: every test there needs it) this skips the module
        pytest.skip(f"needs the shared test data at {path} (see ../shared/data/SOURCES.md)", allow_module_level=True)
    return path


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, Path]:
    """Log and cache dirs inside the test's tmp dir, never in the project."""
    return {"log_dir": tmp_path / "logs", "cache_dir": tmp_path / "cache"}


def path_overrides(dirs: dict[str, Path]) -> list[str]:
    return [f"paths.log_dir={dirs['log_dir']}", f"paths.cache_dir={dirs['cache_dir']}"]


def worker_processes():
    """The multiprocessing context for tests that start Python worker processes themselves (gloo ranks of
    src.parallel's pieces, cache builders): forked from multiprocessing's forkserver, which imports torch and
    Lightning once per pytest worker, instead of spawned fresh. A spawned child re-imports them (~7 s of one core,
    `python -X importtime -c "import test_distributed"`) before running a function that takes milliseconds.
    The children are processes of their own all the same: own pid, memory, gloo connections."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "lightning", "numpy"])
    return ctx


@pytest.fixture(autouse=True)
def fresh_interpreters_for_fresh_tests(request, monkeypatch):
    """A test marked `fresh` runs its scripts in fresh interpreters (TEST_FRESH_PROCESSES=1 for its duration), in
    every session: behaviour that only the forking stand-in has cannot hide in what those tests check."""
    if request.node.get_closest_marker("fresh"):
        monkeypatch.setenv("TEST_FRESH_PROCESSES", "1")


def python() -> str:
    """The interpreter tests run scripts with: a stand-in that forks each run from a server that imported torch,
    Lightning and the project once (tests/helpers/forkrun.py), or, with TEST_FRESH_PROCESSES=1, the real one."""
    return sys.executable if os.environ.get("TEST_FRESH_PROCESSES") == "1" else forkrun.interpreter()


def run_script(
    script: str, args: list[str], timeout: int = 600, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    # MASTER_PORT: Lightning's launcher otherwise takes the OS's bind(0) pick, an ephemeral port that another test's
    # gloo connection can take before rank 0 listens on it (EADDRINUSE, seen in CI); free_port() is outside that range
    port = str(free_port())
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1", "MASTER_PORT": port, **(env or {})}
    proc = subprocess.run(
        [python(), script, *args], cwd=ROOT, env=env, capture_output=True, text=True, errors="replace", timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{script} {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


# The full matrix: every architecture x strategy case and the cases the default suite leaves out for time
# (docs/testing.md lists them); TEST_ALL_ARCHITECTURES=1 runs them.
ALL = os.environ.get("TEST_ALL_ARCHITECTURES") == "1"
FULL_MATRIX_ONLY = pytest.mark.skipif(not ALL, reason="in the full matrix only: TEST_ALL_ARCHITECTURES=1 runs it")

_ports = itertools.cycle(range(500))  # reused in turn: a run ends before this worker starts its next


def free_port() -> int:
    """A free TCP port for a rendezvous a test sets up itself (torchrun's --rdzv-endpoint, MASTER_PORT), from a
    range of 500 for this pytest worker below the kernel's ephemeral range: a port from bind(0) (the OS's pick,
    which Lightning's launcher also takes) can be handed out again while the test that got it has not bound it yet,
    and two tests' torchrun agents then shared one store, which the first test's end closed under the other."""
    import socket

    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    base = int(os.environ.get("TEST_PORT_BASE", "25000"))  # another base keeps two pytest sessions apart
    for offset in itertools.islice(_ports, 500):
        port = base + 500 * worker + offset  # above 15000 + a SLURM job id (hydra_ddp.py)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port left in this pytest worker's range")


def gone(pid: int, timeout: float = 10) -> bool:
    """Whether process `pid` has ended (and been reaped) within `timeout` seconds."""
    end = time.time() + timeout
    while time.time() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def read_events(log_dir: Path):
    """All TensorBoard events under `log_dir`, as one EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def event_files(root: Path) -> list[Path]:
    return sorted(root.rglob("events.out.tfevents.*"))


def event_file_pid(path: Path) -> int:
    """TensorBoard names its files events.out.tfevents.<time>.<host>.<pid>.<n>."""
    return int(re.search(r"\.(\d+)\.\d+$", path.name).group(1))


def pytest_configure(config):
    """Under pytest-xdist this runs in the controller before the workers start, and again in each worker:
    the per-clone state below is prepared once, by the controller (or the only process without xdist)."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller has done it
        return
    if os.environ.get("TEST_FRESH_PROCESSES") != "1":  # the fork server all workers share (forkrun.interpreter)
        os.environ["FORKRUN_DIR"] = forkrun.start()
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        cache = getattr(config, "cache", None)  # None under -p no:cacheprovider: each process builds its own then
        if cache is not None:
            path = cache.mkdir("torch_extensions")
            for lock in path.glob("*/lock"):
                lock.unlink()
            os.environ["TORCH_EXTENSIONS_DIR"] = str(path)  # the workers inherit it


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, Lightning, the test modules: ~600k objects) out of the cyclic
    collector's reach for the session, as the fork server does for its runs (tests/helpers/forkrun.py): a full
    collection during an in-process test otherwise walks it all (~0.25 s of one core each time)."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """Slow tests first, so that under pytest-xdist the long runs start early and the quick ones fill the gaps
    at the end instead of one long test running alone (pytest's sort is stable: file order kept within each)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session", autouse=True)
def torch_extensions_dir(tmp_path_factory):
    """DeepSpeed JIT-compiles its C++ ops on first use into TORCH_EXTENSIONS_DIR: CPU Adam (~45 s on 2 idle cores; the
    shared-memory all-reduce it would also build is skipped, tests/helpers/deepspeed_cpu.py). One dir per clone, kept
    in pytest's cache dir between sessions (.pytest_cache; `make clean` removes it) and shared by xdist workers
    (torch's own lock file serialises a build), builds each op once per clone instead of once per test.
    torch rebuilds an op whose sources or flags changed. A build killed midway (a test's timeout, Ctrl+C) leaves
    torch's `lock` file behind, and every later build would wait for it forever: pytest_configure removes them
    when a session starts (one test session per clone at a time). A TORCH_EXTENSIONS_DIR set by the user is kept."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        yield
        return
    os.environ["TORCH_EXTENSIONS_DIR"] = str(tmp_path_factory.mktemp("torch_extensions"))  # no pytest cache
    yield
    os.environ.pop("TORCH_EXTENSIONS_DIR", None)


def once_per_session(tmp_path_factory, name: str, make):
    """make(dir)'s result, computed by one process per test session and read by the others: under pytest-xdist
    every worker runs session fixtures itself, so the runs they share are made once, under a file lock, in the
    session's base temp dir (the workers' common parent; unique per session) and read back from a pickle."""
    import pickle

    from filelock import FileLock

    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # no xdist: this process is the session
        return make(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent / "shared_runs"
    root.mkdir(exist_ok=True)
    result = root / f"{name}.pkl"
    with FileLock(str(result) + ".lock"):
        if not result.exists():
            work = root / name
            shutil.rmtree(work, ignore_errors=True)  # what a failed make() by another worker left: make it again
            work.mkdir()
            value = make(work)
            result.write_bytes(pickle.dumps(value))
        return pickle.loads(result.read_bytes())


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """A run that several tests compare against (2-rank DDP GPT-2, a 1-process convnet), trained once per
    session (once for all xdist workers): reference(args) is test_parity.train's result for `args`, the same
    dict for the same args. Callers only read it (parameters and logged series)."""
    import hashlib

    runs: dict[tuple[str, ...], dict] = {}

    def get(args: list[str]) -> dict:
        from test_parity import train

        key = tuple(args)
        if key not in runs:
            name = "reference-" + hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]
            runs[key] = once_per_session(tmp_path_factory, name, lambda tmp: train(tmp, "run", list(args)))
        return runs[key]

    return get


@pytest.fixture(scope="session")
def fsdp_checkpoint(tmp_path_factory) -> Path:
    """The sharded last.ckpt of a 2-step, 2-rank FSDP2 GPT-2 run (test_parity.GPT2), trained once per session
    (once for all xdist workers) for the tests that only read one (export, consolidation, eval.py). Readers
    write their outputs elsewhere."""
    from test_parity import GPT2, QUIET

    def make(tmp: Path) -> Path:
        run_script(
            "train.py",
            QUIET
            + path_overrides({"log_dir": tmp / "logs", "cache_dir": tmp / "cache"})
            + GPT2
            + ["trainer=fsdp", "trainer.devices=2", "trainer.max_steps=2", "trainer.val_check_interval=2"],
        )
        (run,) = (tmp / "logs" / "train" / "runs").iterdir()
        return run / "checkpoints" / "last.ckpt"

    return once_per_session(tmp_path_factory, "fsdp_checkpoint", make)
