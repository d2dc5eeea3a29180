"""Test-only fault for tests/test_divergence.py, loaded into real train.py runs with
+callbacks.nan._target_=tests.helpers.divergence.InjectNaN."""

from __future__ import annotations

from typing import Optional

import lightning as L
import torch


class InjectNaN(L.Callback):
    """Before optimizer step `step` (1-based), set one weight to NaN on rank `rank` (every rank if None), so
    that step's loss and gradients are NaN there. Rank 0 saves the state before the fault to `before_nan.pt`
    in the run dir. restore=True puts the weight back before the optimizer step: only the loss and the
    gradients of that one step are NaN (a bad batch), and the state after it is saved to `after_nan.pt`."""

    def __init__(self, step: int, rank: Optional[int] = None, restore: bool = False) -> None:
        self.step, self.rank, self.restore = step, rank, restore
        self.done, self.saved, self.after = False, None, False

    def _save(self, trainer: L.Trainer, pl_module: L.LightningModule, name: str) -> None:
        if trainer.is_global_zero:
            state = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}
            torch.save({"global_step": trainer.global_step, "state_dict": state}, f"{trainer.default_root_dir}/{name}")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.global_step != self.step - 1 or self.done:
            return
        self.done = True
        self._save(trainer, pl_module, "before_nan.pt")
        if self.rank is None or trainer.global_rank == self.rank:
            weight = next(pl_module.parameters()).view(-1)
            self.saved = weight[0].item()
            with torch.no_grad():
                weight[0] = float("nan")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if self.restore and self.saved is not None:
            with torch.no_grad():
                next(pl_module.parameters()).view(-1)[0] = self.saved
            self.saved = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if self.restore and self.done and not self.after and trainer.global_step == self.step:
            self.after = True
            self._save(trainer, pl_module, "after_nan.pt")


class InfGradient(L.Callback):
    """After the backward of optimizer step `step` (1-based), one gradient element becomes inf: the overflow an fp16
    GradScaler sees (the loss stays finite). Rank 0 saves the state before that step's update to `before_inf.pt`
    and after it to `after_inf.pt` in the run dir."""

    def __init__(self, step: int) -> None:
        self.step, self.after = step, False

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == self.step - 1:
            InjectNaN._save(self, trainer, pl_module, "before_inf.pt")
            grad = next(p for p in pl_module.parameters() if p.grad is not None).grad
            grad.view(-1)[0] = float("inf")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.global_step == self.step and not self.after:
            self.after = True
            InjectNaN._save(self, trainer, pl_module, "after_inf.pt")
