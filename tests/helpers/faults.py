"""Test-only faults for tests/test_hangs.py, loaded into real train.py runs with
+callbacks.fault._target_=tests.helpers.faults.RankFault."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Optional

import lightning as L
import torch
import torch.distributed as dist


def write_whole(path: Path, text: str) -> None:
    """`text` into `path`, which appears whole at once (written aside, then renamed): a test polling for the file
    reads it as soon as it exists (a marker created empty and filled after was once read empty)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class RankFault(L.Callback):
    """Every rank writes its pid to `pid_rank<r>` in the run dir; at optimizer step `step`, rank `rank` misbehaves.

    action="all_reduce": one extra all_reduce the other ranks never call (a mismatched collective);
    action="kill": SIGKILL itself (a crashed or OOM-killed rank); action="kill_node": SIGKILL its node's torchrun
    agent and then itself, as a node that disappears. The agent is the process whose pid the file named by
    $AGENT_PID_FILE holds (a rank run through the tests' stand-in python is not the agent's child), else the
    parent. Before acting it writes `fault_rank<r>`.
    """

    def __init__(self, step: int, action: str, rank: int = 1, only_where_env: Optional[str] = None) -> None:
        """only_where_env: act in the process whose environment has this variable set to 1 (e.g. one torchrun
        node's), whatever its rank, instead of on `rank`."""
        if action not in ("all_reduce", "kill", "kill_node"):
            raise ValueError(f"RankFault action {action!r}: use all_reduce, kill or kill_node.")
        self.step, self.action, self.rank, self.only_where_env = step, action, rank, only_where_env

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        write_whole(Path(trainer.default_root_dir, f"pid_rank{trainer.global_rank}"), str(os.getpid()))

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        here = os.environ.get(self.only_where_env) == "1" if self.only_where_env else trainer.global_rank == self.rank
        if trainer.global_step != self.step or not here:
            return
        Path(trainer.default_root_dir, f"fault_rank{trainer.global_rank}").write_text(self.action)
        if self.action == "kill_node":
            agent = os.environ.get("AGENT_PID_FILE")
            os.kill(int(Path(agent).read_text()) if agent else os.getppid(), signal.SIGKILL)
        if self.action in ("kill", "kill_node"):
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(1))
