"""Test-only callbacks, instantiated into real train.py runs with +callbacks.NAME._target_=..."""

from __future__ import annotations

import json

import lightning as L
import torch


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2 DTensor: this rank's shard only
    return t.numel() * t.element_size()


class RecordStateBytes(L.Callback):
    """Writes this rank's parameter, gradient and optimizer-state bytes just before the 2nd optimizer step."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if trainer.global_step != 1:  # the optimizer state exists from the first step on
            return
        params = [p for p in pl_module.parameters()]
        record = {
            "params": sum(local_bytes(p) for p in params),
            "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(local_bytes(v) for s in optimizer.state.values() for v in s.values()
                             if torch.is_tensor(v) and v.dim() > 0),  # m and v; not the scalar step counters
        }
        path = f"{trainer.default_root_dir}/state_bytes_rank{trainer.global_rank}.json"
        with open(path, "w") as f:
            json.dump(record, f)


class SaveParamsAtEnd(L.Callback):
    """Every rank saves its full parameters at the end of fit: proof that ranks trained in lockstep."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import os

        params = {k: v.detach().cpu() for k, v in pl_module.state_dict().items()}
        torch.save(params, os.path.join(trainer.default_root_dir, f"params_rank{trainer.global_rank}.pt"))


class RecordEnv(L.Callback):
    """Writes the job's environment as every rank sees it."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        import os

        with open(f"{trainer.default_root_dir}/env_rank{trainer.global_rank}.json", "w") as f:  # noqa: PTH123
            json.dump(dict(os.environ), f)


class KillAtStep(L.Callback):
    """Simulates a preemption: SIGKILL this process (no cleanup, no final checkpoint) at a given step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        import os
        import signal

        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
