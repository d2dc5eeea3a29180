"""Test-only: make one sharded save slow enough to be killed in the middle of it.

Loaded into a real train.py run with `+callbacks.slow._target_=tests.helpers.checkpoint_faults.StallShardedSave`.
At global step `step`, the DCP writer of a checkpoint named `name` writes every rank's shard files
and then stalls before the `.metadata` is written, after leaving a `saving_rank<R>` marker (holding the rank's
pid) in the run dir: the test waits for the markers, SIGKILLs the whole process group and waits for those pids.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import lightning as L
from torch.distributed.checkpoint import filesystem

from tests.helpers.faults import write_whole


def mark_saving(trainer: L.Trainer) -> None:
    """The run dir's `saving_rank<R>` marker, holding this rank's pid; the test reads it as soon as it exists."""
    write_whole(Path(trainer.default_root_dir, f"saving_rank{trainer.global_rank}"), str(os.getpid()))


class StallShardedSave(L.Callback):
    def __init__(self, step: int, name: str = "last.ckpt") -> None:
        self.step, self.name = step, name

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        original, callback = filesystem._FileSystemWriter.write_data, self

        def write_data(writer, plan, planner):
            done = original(writer, plan, planner)
            if trainer.global_step == callback.step and callback.name in str(writer.path):
                done.wait()  # this rank's shard files are on disk
                mark_saving(trainer)
                time.sleep(600)  # killed here
            return done

        filesystem._FileSystemWriter.write_data = write_data


class HideCheckpointsOnRank(L.Callback):
    """Rank `rank` sees an empty checkpoints dir when it decides resume=auto itself (a lagging shared file system)."""

    def __init__(self, rank: int = 1) -> None:
        import os

        import src.run.job as run

        if int(os.environ.get("LOCAL_RANK", 0)) == rank:
            from src.checkpoint import files as checkpointing

            checkpointing.candidates = lambda ckpt_dir: []
            run.Path = _NoCheckpoints  # old code looked at Path(...)/"last.ckpt" directly


class _NoCheckpoints(type(Path())):
    def exists(self, *args, **kwargs) -> bool:
        return False if self.name == "last.ckpt" else super().exists(*args, **kwargs)


class RecordStartStep(L.Callback):
    """Each rank writes the global step it starts training from (after any checkpoint was restored)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        Path(trainer.default_root_dir, f"start_step_rank{trainer.global_rank}").write_text(str(trainer.global_step))


class StallDeepSpeedSave(L.Callback):
    """As StallShardedSave, for DeepSpeed: the model states of the save at `step` are written, then every rank
    stalls before writing its ZeRO optimizer partition."""

    def __init__(self, step: int, name: str = "last.ckpt") -> None:
        self.step, self.name = step, name

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from deepspeed.runtime.engine import DeepSpeedEngine

        original, callback = DeepSpeedEngine._save_zero_checkpoint, self

        def save_zero(engine, save_path, tag):
            if trainer.global_step == callback.step and callback.name in str(save_path):
                mark_saving(trainer)
                time.sleep(600)  # killed here
            return original(engine, save_path, tag)

        DeepSpeedEngine._save_zero_checkpoint = save_zero
