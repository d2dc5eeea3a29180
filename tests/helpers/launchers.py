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
# stand-in for SLURM's scontrol: record the call, then end the job like `scontrol requeue` does
import os, signal, sys
with open({record!r}, "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
if sys.argv[1:2] == ["requeue"]:
    os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
"""


def stand_in_scontrol(bin_dir: Path, record: Path, python: str) -> Path:
    """An executable `scontrol` in `bin_dir` (put it first on PATH)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / "scontrol"
    path.write_text(SCONTROL.format(python=python, record=str(record)))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path
