"""Callbacks that make a run end the same way whatever launched it and however it was cut short."""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from typing import Any, Optional

import lightning as L

from src.distributed import launcher_env

log = logging.getLogger(__name__)


class ValidateAtEnd(L.Callback):
    """Validate once more at the end of training when the last step was not a validation step.

    Without it, max_steps=6 with val_check_interval=100 ends without any validation: no val metrics,
    no best checkpoint, and nothing for a sweeper to read. Asking the loop to stop at the last step
    makes Lightning run its validation there (as for early stopping); a run whose last step already
    validates is unchanged.
    """

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps and trainer.limit_val_batches != 0:
            trainer.should_stop = True


class Preemption(L.Callback):
    """SLURM preemption and time limits, end to end: at `signal` write last.ckpt, `scontrol requeue` the job
    and wait to be stopped; the requeued job (same job id, so the same run dir) continues from last.ckpt
    with resume=auto.

    The signal is the one submitit asks SLURM for (`--signal=USR2@<signal_delay_s>`); in your own sbatch
    script use `#SBATCH --signal=USR2@120` with srun. Lightning's own SLURM handler listens on SIGUSR1,
    writes hpc_ckpt_<n>.ckpt that only a run with ckpt_path=null would pick up, and ignores SIGTERM; it is
    switched off so this is the only mechanism. SLURM signals every task, not necessarily at the same step,
    so the ranks agree on the step (one all-reduce every `check_every_n_steps` steps when there are several).
    """

    def __init__(self, checkpoint: str, signal_name: str = "SIGUSR2", check_every_n_steps: int = 10,
                 resume: Optional[str] = None, wait_s: float = 300.0) -> None:
        self.checkpoint = checkpoint
        self.signum = signal.Signals[signal_name]
        self.check_every_n_steps = max(1, int(check_every_n_steps))
        self.resume = resume
        self.wait_s = wait_s
        self.received = False
        self._previous: Any = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if getattr(environment, "auto_requeue", False):  # Lightning's SLURMEnvironment
            environment.auto_requeue = False  # read when Lightning registers its signal handlers, after setup

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.received = False
        self._previous = signal.signal(self.signum, self._note)  # after Lightning's (and submitit's) handlers

    def _note(self, signum: int, frame: Any) -> None:
        self.received = True  # act between steps, not inside the handler

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.world_size > 1:
            if trainer.global_step % self.check_every_n_steps:
                return
            preempted = trainer.strategy.reduce_boolean_decision(self.received, all=False)
        else:
            preempted = self.received
        if not preempted:
            return
        log.warning(f"{self.signum.name} at step {trainer.global_step}: saving {self.checkpoint} and requeueing")
        trainer.save_checkpoint(self.checkpoint)  # every rank: sharded strategies write together
        if self.resume != "auto":
            log.warning("resume is not 'auto': the requeued job will start again from step 0. Set resume=auto.")
        if launcher_env.slurm_job_id() is None:
            log.warning("Not in a SLURM batch job: nothing to requeue; stopping. Run the same command to continue.")
            trainer.should_stop = True
            return
        if trainer.is_global_zero:
            self._requeue()
        trainer.strategy.barrier("preempted")
        time.sleep(self.wait_s)  # SLURM ends the job now; train no further, so last.ckpt stays as written
        log.warning(f"Still running {self.wait_s:.0f}s after the requeue: stopping here")
        trainer.should_stop = True

    @staticmethod
    def _requeue() -> None:
        job = launcher_env.slurm_job_id()
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        if result.returncode == 0:
            log.info(f"Requeued SLURM job {job}")
        else:
            log.warning(f"scontrol requeue {job} failed ({result.returncode}): {result.stderr.strip()}")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None

