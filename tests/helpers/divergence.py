"""Test-only fault for tests/test_divergence.py, loaded into real train.py runs with
+callbacks.nan._target_=tests.helpers.divergence.InjectNaN."""

from __future__ import annotations

import lightning as L
import torch


class InjectNaN(L.Callback):
    """Before optimizer step `step` (1-based), set one weight to NaN on rank `rank` (every rank if None), so
    that step's loss is NaN there. Saves the state before the fault to `before_nan.pt` in the run dir."""

    def __init__(self, step: int, rank: int | None = None) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.global_step != self.step - 1 or self.done:
            return
        if trainer.is_global_zero:
            state = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}
            torch.save({"global_step": trainer.global_step, "state_dict": state},
                       f"{trainer.default_root_dir}/before_nan.pt")
        if self.rank is None or trainer.global_rank == self.rank:
            with torch.no_grad():
                next(pl_module.parameters()).view(-1)[0] = float("nan")
        self.done = True

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.done = False
