"""Shared helpers: compose configs in-process, run train.py / eval.py as real subprocesses, read TensorBoard."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub requests from tests: fail fast instead of retrying

import src.utils.resolvers  # noqa: E402,F401
from src.utils.config import register_schemas  # noqa: E402

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
        pytest.skip(f"needs the shared test data at {path} (see ../shared/data/SOURCES.md)")
    return path


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, Path]:
    """Log and cache dirs inside the test's tmp dir, never in the project."""
    return {"log_dir": tmp_path / "logs", "cache_dir": tmp_path / "cache"}


def path_overrides(dirs: dict[str, Path]) -> list[str]:
    return [f"paths.log_dir={dirs['log_dir']}", f"paths.cache_dir={dirs['cache_dir']}"]


def run_script(script: str, args: list[str], timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"}
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc


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


@pytest.fixture(scope="session", autouse=True)
def torch_extensions_dir(request, tmp_path_factory):
    """DeepSpeed JIT-compiles its C++ ops on first use into TORCH_EXTENSIONS_DIR: CPU Adam (~1 min on 2 cores)
    and, in every DeepSpeed process on CPU, its shared-memory all-reduce (~35 s). One dir for the whole session,
    kept in pytest's cache dir between sessions (.pytest_cache; `make clean` removes it), builds each once per
    clone instead of once per test module or test. torch rebuilds an op whose sources or flags changed.
    A build killed midway (a test's timeout, Ctrl+C) leaves torch's `lock` file behind, and every later build
    would wait for it forever: a new session removes them (one test session per clone at a time).
    A TORCH_EXTENSIONS_DIR set by the user is kept."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        yield
        return
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider: a session temp dir then
    path = cache.mkdir("torch_extensions") if cache is not None else tmp_path_factory.mktemp("torch_extensions")
    for lock in path.glob("*/lock"):
        lock.unlink()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(path)
    yield
    os.environ.pop("TORCH_EXTENSIONS_DIR", None)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """A run that several tests compare against (2-rank DDP GPT-2, a 1-process convnet), trained once per
    session: reference(args) is test_parity.train's result for `args`, the same dict for the same args.
    Callers only read it (parameters and logged series)."""
    runs: dict[tuple[str, ...], dict] = {}

    def get(args: list[str]) -> dict:
        from test_parity import train

        key = tuple(args)
        if key not in runs:
            runs[key] = train(tmp_path_factory.mktemp("reference"), "run", list(args))
        return runs[key]

    return get


@pytest.fixture(scope="session")
def fsdp_checkpoint(tmp_path_factory) -> Path:
    """The sharded last.ckpt of a 2-step, 2-rank FSDP2 GPT-2 run (test_parity.GPT2), trained once per session
    for the tests that only read one (export, consolidation, eval.py). Readers write their outputs elsewhere."""
    from test_parity import GPT2, QUIET

    tmp = tmp_path_factory.mktemp("fsdp_checkpoint")
    run_script("train.py", QUIET + path_overrides({"log_dir": tmp / "logs", "cache_dir": tmp / "cache"}) + GPT2
               + ["trainer=fsdp", "trainer.devices=2", "trainer.max_steps=2", "trainer.val_check_interval=2"])
    (run,) = (tmp / "logs" / "train" / "runs").iterdir()
    return run / "checkpoints" / "last.ckpt"
