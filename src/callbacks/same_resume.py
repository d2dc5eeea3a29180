"""resume=auto's one check once the ranks can talk: they all start from the checkpoint rank 0 chose."""

from __future__ import annotations

import json
import os
from typing import Any

from lightning.pytorch.callbacks import Callback

from src.checkpoint.files import RESUME_ENV


class SameResumeOnAllRanks(Callback):
    """Stop with one sentence when ranks chose different resume points, before any checkpoint is loaded.

    resume=auto is rank 0's decision for the ranks Lightning's launcher starts (they inherit it) and
    under torchrun (rank 0 posts it in the rendezvous store): src/checkpoint/latest.py resume_from. Ranks
    started together by other means (SLURM's srun, one Lightning launcher per node) each looked at
    the file system before any process group existed, and on a shared file system their views may
    differ: mixing two steps would train silently wrong, so once the group is up they compare.
    """

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or trainer.world_size == 1 or RESUME_ENV not in os.environ:
            return
        mine = json.loads(os.environ[RESUME_ENV]).get("ckpt")
        rank0 = trainer.strategy.broadcast(mine, src=0)
        if trainer.strategy.reduce_boolean_decision(mine != rank0, all=False):
            who = f"rank {trainer.global_rank} chose {mine}" if mine != rank0 else "another rank chose differently"
            raise RuntimeError(
                f"resume=auto: {who} but rank 0 chose {rank0} (their views of the file system differ); "
                f"pass ckpt_path={rank0} so every rank starts from the same checkpoint."
            )
