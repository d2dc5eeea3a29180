"""Test-only callbacks and stand-ins for launcher tests: cut a real run short the way a cluster would."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import lightning as L


class KillRankAtStep(L.Callback):
    """SIGKILL this process on global rank `rank` at `step`, in torchrun's first attempt only (a rank that dies)."""

    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class SignalAtStep(L.Callback):
    """Send this process `signal_name` at `step` on global rank `rank`: SLURM's warning before preemption,
    arriving at one rank only (the others must still agree to stop at the same step)."""

    def __init__(self, step: int, rank: int = 1, signal_name: str = "SIGUSR2") -> None:
        self.step, self.rank, self.signum = step, rank, signal.Signals[signal_name]

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


SCONTROL = """#!{python}
# stand-in for SLURM's scontrol: record the call, then (end_job) end the job like `scontrol requeue` does
import os, signal, sys
with open({record!r}, "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
if sys.argv[1:2] == ["requeue"] and {end_job}:
    job = {job_pgid_file!r}  # the job's process group when the test names it, else its caller's
    os.killpg(int(open(job).read()) if job else os.getpgid(os.getppid()), signal.SIGKILL)
"""


def stand_in_scontrol(
    bin_dir: Path, record: Path, python: str, end_job: bool = True, job_pgid_file: Path | None = None
) -> Path:
    """An executable `scontrol` in `bin_dir` (put it first on PATH); end_job=False only records the call.
    `scontrol requeue` SIGKILLs its caller's process group, or the group whose id `job_pgid_file` holds: the tasks'
    group when they run through the tests' stand-in python, whose runs are forked in the stand-in server's group."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / "scontrol"
    path.write_text(
        SCONTROL.format(
            python=python, record=str(record), end_job=end_job, job_pgid_file=job_pgid_file and str(job_pgid_file)
        )
    )
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


class SlowSteps(L.Callback):
    """Sleep `seconds` before every training step in a SLURM job's first `attempts` attempts (SLURM_RESTART_COUNT),
    so that a signal lands mid-training; rank 0 appends "<attempt> <step> <time>" to <run dir>/progress.txt
    after each step."""

    def __init__(self, seconds: float, attempts: int = 100) -> None:
        self.seconds, self.attempts = seconds, attempts
        self.attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0)

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        import time

        if self.attempt < self.attempts:
            time.sleep(self.seconds)

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        import time

        if trainer.is_global_zero:
            with open(os.path.join(trainer.default_root_dir, "progress.txt"), "a") as f:
                f.write(f"{self.attempt} {trainer.global_step} {time.time():.3f}\n")
