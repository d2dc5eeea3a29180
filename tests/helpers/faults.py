"""Test-only faults for tests/test_hangs.py, loaded into real train.py runs with
+callbacks.fault._target_=tests.helpers.faults.RankFault."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist


class RankFault(L.Callback):
    """Every rank writes its pid to `pid_rank<r>` in the run dir; at optimizer step `step`, rank `rank` misbehaves.

    action="all_reduce": one extra all_reduce the other ranks never call (a mismatched collective);
    action="kill": SIGKILL itself (a crashed or OOM-killed rank). Before acting it writes `fault_rank<r>`.
    """

    def __init__(self, step: int, action: str, rank: int = 1) -> None:
        if action not in ("all_reduce", "kill"):
            raise ValueError(f"RankFault action {action!r}: use all_reduce or kill.")
        self.step, self.action, self.rank = step, action, rank

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        Path(trainer.default_root_dir, f"pid_rank{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step != self.step or trainer.global_rank != self.rank:
            return
        Path(trainer.default_root_dir, f"fault_rank{self.rank}").write_text(self.action)
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(1))
