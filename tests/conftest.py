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
