"""SLURM preemption and time limits: a run cut short by its launcher ends the same way, and its requeued job continues."""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from typing import Any, Optional

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from src.launch import launcher_env
from src.parallel import capabilities

log = logging.getLogger(__name__)


class Preemption(L.Callback):
    """SLURM preemption and time limits, end to end: at `signal` write last.ckpt, `scontrol requeue` the job
    and wait for SLURM to end it; the requeued job (same job id, so the same run dir) continues from last.ckpt
    with resume=auto.

    The signal is the one submitit asks SLURM for (`--signal=USR2@<signal_delay_s>`); in your own sbatch
    script use `#SBATCH --signal=USR2@120` with srun (scripts/train.sbatch). Lightning's own SLURM handler
    listens on SIGUSR1, writes hpc_ckpt_<n>.ckpt that only a run with ckpt_path=null would pick up, and
    ignores SIGTERM; it is switched off so this is the only mechanism. SLURM signals every task, not
    necessarily at the same step, so the ranks agree on the step (one all-reduce every `check_every_n_steps`
    steps when there are several).

    After the requeue SLURM ends the job with SIGTERM (then SIGKILL after its KillWait). The ranks wait for it
    where the step's metrics are logged and its validation (if due) has run: Lightning does not validate that
    step again on resume, so this keeps every logger's history whole. From the requeue on, SIGTERM only sets a
    flag (Lightning's handler broadcasts from inside the handler, which could meet the requeue's broadcast or
    a validation collective on another rank); the wait sees it within 0.1 s and the run exits 143.
    """

    def __init__(
        self,
        checkpoint: str,
        signal_name: str = "SIGUSR2",
        check_every_n_steps: int = 10,
        resume: Optional[str] = None,
        wait_s: float = 300.0,
    ) -> None:
        self.checkpoint = checkpoint
        self.signum = signal.Signals[signal_name]
        self.check_every_n_steps = max(1, int(check_every_n_steps))
        self.resume = resume
        self.wait_s = wait_s
        self.received = self.requeued = self.terminated = False
        self._previous: Any = None
        self._lightning_sigterm: Any = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        environment = capabilities.cluster_environment(trainer.strategy)
        if getattr(environment, "auto_requeue", False):  # Lightning's SLURMEnvironment
            environment.auto_requeue = False  # read when Lightning registers its signal handlers, after setup
        if stage == "fit" and self._previous is None:  # after Lightning's (and submitit's) handlers; a signal
            self._previous = signal.signal(self.signum, self._note)  # during start-up counts at the first step
            self.received = self.received or self.signum in launcher_env.EARLY_SIGNALS

    def _note(self, signum: int, frame: Any) -> None:
        self.received = True  # act between steps, not inside the handler

    def _note_sigterm(self, signum: int, frame: Any) -> None:
        self.terminated = True

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.requeued:
            return
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
        self._lightning_sigterm = signal.signal(signal.SIGTERM, self._note_sigterm)
        self.requeued = trainer.strategy.broadcast(self._requeue() if trainer.is_global_zero else False, src=0)
        if not self.requeued:
            signal.signal(signal.SIGTERM, self._lightning_sigterm)
            log.warning(
                f"Continuing without a requeue: when SLURM ends this job, resume from {self.checkpoint} "
                "(resume=auto in the same run dir)."
            )
            self.received = False
            if self.terminated and callable(self._lightning_sigterm):  # SIGTERM came meanwhile: Lightning's
                self._lightning_sigterm(signal.SIGTERM, None)  # handler has it, now that the ranks agree again

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._wait_for_sigterm(trainer)  # the requeued step is logged and validated by now

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._wait_for_sigterm(trainer)  # requeued at the last step: not on to testing

    def _wait_for_sigterm(self, trainer: L.Trainer) -> None:
        if not self.requeued:
            return
        self.requeued = False
        for logger in trainer.loggers:
            logger.save()  # what was logged is on disk, whatever ends this process
        deadline = time.monotonic() + self.wait_s
        while not self.terminated and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.terminated:
            raise SIGTERMException  # exit status 143 (src/launch/timeouts.py)
        signal.signal(signal.SIGTERM, self._lightning_sigterm)
        log.warning(f"Still running {self.wait_s:.0f}s after the requeue: stopping here")
        trainer.should_stop = True

    @staticmethod
    def _requeue() -> bool:
        job = launcher_env.slurm_job_id()
        try:
            result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:  # e.g. no scontrol in a container
            log.warning(f"scontrol requeue {job} failed: {e}")
            return False
        if result.returncode != 0:
            log.warning(f"scontrol requeue {job} failed ({result.returncode}): {result.stderr.strip()}")
            return False
        log.info(f"Requeued SLURM job {job}")
        return True

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None
