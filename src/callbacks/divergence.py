"""Stop a run whose loss turns NaN/inf, and never let it overwrite a good checkpoint with NaN weights.

Without this a diverged run trains on NaN to the end and rewrites last.ckpt with NaN weights, so the
state to go back to is lost. Checks happen only where the host waits for the device anyway, so
training runs without any extra host sync per step:

* every step, `LitModule.log_train_loss` hands the step's loss to `watch_step_loss`, which notes on
  the device the first step whose loss is not finite; on logging steps the flag rides in the
  train-loss all-reduce and is read here after the step (Lightning reads the logged loss then anyway);
* at validation end, non-finite `val/...` metrics (GPT-2's TokenMeanLoss keeps NaN) or a pending flag;
* before every checkpoint save (`on_save_checkpoint`, which every rank runs): a pending flag or a
  non-finite parameter vetoes the save, so last.ckpt and the best checkpoint stay finite.

Each decision is reduced over ranks, so all ranks stop together (no rank is left waiting in a
collective). `action=stop` raises `DivergenceError` naming the step and the last good checkpoint:
the job exits 1. `action=skip` skips the optimizer update of each step with non-finite gradients on
the device (the fused optimizers' `found_inf` input, as torch's GradScaler uses it): no host sync.
It needs gradients that are the same on every rank (1 device or DDP) and a fused optimizer
(`model.optimizer.fused=true`, the default); under fp16 the GradScaler already skips such steps.

Under fp16 (`trainer.precision=16-mixed`, Lightning's GradScaler) a step whose scaled gradients overflow is
skipped by the scaler, which halves the loss scale (and doubles it again after `growth_interval` good steps):
routine, and silent in Lightning. Here, on logging steps, `train/loss_scale` and `train/skipped_updates` (the
optimizer updates skipped since training began: optimizer steps taken minus the optimizer's own update count,
so no host sync per step) are logged, and a console line says when the count grows.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn

from src.checkpoint.files import candidates
from src.parallel import capabilities
from src.utils.errors import UserError

log = logging.getLogger(__name__)
ACTIONS = ("stop", "skip")
ADVICE = (
    "To go on from it, run again with resume=auto (same hydra.run.dir) and a lower model.optimizer.lr or "
    "trainer.gradient_clip_val; callbacks.divergence.action=skip skips non-finite steps instead"
)


def optimizer_updates(optimizer: torch.optim.Optimizer) -> Optional[int]:
    """How many updates the optimizer has made: its per-parameter `step` count (Adam, AdamW, ...; a step the
    GradScaler skips does not count it). None for an optimizer without one (SGD), or before its state exists."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            count = optimizer.state.get(p, {}).get("step")
            if count is not None:
                return int(count)
    return None


class DivergenceError(UserError, RuntimeError):
    """Training diverged (non-finite loss or weights) and callbacks.divergence.action is stop. Every rank
    raises it at the same step with the same message; `user_errors` prints it once (rank 0) and exits 2."""

    same_on_every_rank = True


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2 DTensor: this rank's shard


class Divergence(L.Callback):
    def __init__(self, action: str = "stop") -> None:
        if action not in ACTIONS:
            raise ValueError(f"callbacks.divergence.action={action!r}: use one of {', '.join(ACTIONS)}.")
        self.action = action
        self.skipped: Optional[torch.Tensor] = None  # on the device: optimizer updates skipped (action=skip)
        self._last_saved_step: Optional[int] = None
        self._scaler_skipped, self._scale_logged_at = 0, 0  # fp16: the GradScaler's skips as last logged, and when
        # on the device, the first optimizer step (1-based) since the last check whose loss was not finite (inf:
        # none); on logging steps, its flag's mean over ranks
        self.first_nonfinite: Optional[torch.Tensor] = None
        self.nonfinite_reduced: Optional[torch.Tensor] = None

    # ---- the train loss, on the device: LitModule.log_train_loss calls these (src/core/module.py) ----

    def watch_step_loss(self, step_loss: torch.Tensor, step: int, logging: bool) -> Optional[torch.Tensor]:
        """Remember, on the device, the first step whose loss is not finite: no host sync. On logging steps, the
        flag to ride in the loss's all-reduce: its mean is > 0 iff a rank saw one."""
        if self.first_nonfinite is None:
            self.first_nonfinite = torch.full((), math.inf, device=step_loss.device)
        bad = ~torch.isfinite(step_loss)
        self.first_nonfinite = torch.where(bad, self.first_nonfinite.clamp(max=step), self.first_nonfinite)
        return torch.isfinite(self.first_nonfinite).float() if logging else None

    def step_loss_reduced(self, mean: torch.Tensor) -> None:
        self.nonfinite_reduced = mean

    # ---- skip: on the device, before each optimizer step ----

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.skipped = None
        updates = optimizer_updates(trainer.optimizers[0]) if trainer.optimizers else None  # resumed: so far
        self._scaler_skipped = trainer.global_step - updates if updates is not None else 0
        self._scale_logged_at = trainer.global_step
        if self.action != "skip":
            return
        strategy = trainer.strategy
        if not capabilities.of(strategy).grads_whole:
            raise ValueError(
                f"callbacks.divergence.action=skip needs gradients that every rank holds whole "
                f"(1 device or trainer=ddp), not {type(strategy).__name__}: use action=stop."
            )
        for optimizer in trainer.optimizers:
            # torch's mark for optimizers that take GradScaler's on-device `found_inf` (fused Adam/AdamW/SGD)
            if not getattr(optimizer, "_step_supports_amp_scaling", False):
                raise ValueError(
                    f"callbacks.divergence.action=skip needs a fused optimizer, not "
                    f"{type(optimizer).__name__} without fused=True: set model.optimizer.fused=true "
                    f"or use action=stop."
                )

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.action != "skip" or getattr(trainer.precision_plugin, "scaler", None) is not None:
            return  # fp16: the GradScaler sets found_inf itself and skips non-finite steps already
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            # Same on every rank (DDP has averaged the gradients); the fused step skips the update if > 0
            norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
            optimizer.found_inf = (~torch.isfinite(norm)).float()
            self.skipped = optimizer.found_inf if self.skipped is None else self.skipped + optimizer.found_inf

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        for optimizer in trainer.optimizers:
            if hasattr(optimizer, "found_inf") and getattr(trainer.precision_plugin, "scaler", None) is None:
                del optimizer.found_inf
        self._log_loss_scale(trainer, pl_module)
        reduced = self.nonfinite_reduced
        if reduced is None:
            return
        self.nonfinite_reduced = None
        if reduced.item() > 0:  # the host waits here anyway: Lightning reads the logged loss next
            self._diverged(trainer, pl_module, "the train loss was not finite")

    # ---- validation and checkpoint saves: sync points, checked on every rank ----

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        metrics = trainer.callback_metrics
        bad = sorted(
            k for k, v in metrics.items() if k.startswith("val/") and torch.is_tensor(v) and not torch.isfinite(v).all()
        )
        if self._any_rank(trainer, bool(bad) or self._pending()):
            what = ", ".join(f"{k}={metrics[k].item():g}" for k in bad) if bad else "the train loss was not finite"
            self._diverged(trainer, pl_module, what, force_stop=bool(bad))

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        """A save waits for the device anyway: one look at every local parameter, one all-reduce."""
        weights_bad = not all(bool(torch.isfinite(_local(p)).all()) for p in pl_module.parameters())
        loss_bad = self.action == "stop" and self._pending()
        bad = torch.tensor([weights_bad, loss_bad], dtype=torch.float32, device=trainer.strategy.root_device)
        if trainer.world_size > 1:
            bad = trainer.strategy.reduce(bad, reduce_op="sum")
        if bad.any():
            what = "the weights are not finite" if bad[0] > 0 else "the train loss was not finite"
            self._diverged(trainer, pl_module, what, force_stop=True, saving=True)
        self._last_saved_step = trainer.global_step

    # ---- fp16: the GradScaler's skips ----

    def _log_loss_scale(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """On a logging step that ends an optimizer step, under a GradScaler: its loss scale and the updates it has
        skipped (see the module docstring). The host waits for the device on logging steps anyway."""
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        step = trainer.global_step
        if scaler is None or not scaler.is_enabled() or step % max(1, trainer.log_every_n_steps):
            return
        if step == self._scale_logged_at:  # a micro-batch that ended no step (gradient accumulation)
            return
        self._scale_logged_at = step
        scale = scaler.get_scale()
        metrics = {"train/loss_scale": scale}
        updates = optimizer_updates(trainer.optimizers[0])
        if updates is not None:
            skipped = step - updates
            metrics["train/skipped_updates"] = float(skipped)
            if skipped > self._scaler_skipped and trainer.is_global_zero:
                log.info(
                    f"fp16: {skipped - self._scaler_skipped} optimizer update(s) skipped by step {step} (gradients "
                    f"not finite after loss scaling; {skipped} since training began); the loss scale is now {scale:g}."
                )
            self._scaler_skipped = skipped
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)

    # ---- helpers ----

    def _pending(self) -> bool:
        first = self.first_nonfinite
        return first is not None and bool(torch.isfinite(first))

    @staticmethod
    def _any_rank(trainer: L.Trainer, flag: bool) -> bool:
        if trainer.world_size == 1:
            return flag
        return trainer.strategy.reduce_boolean_decision(flag, all=False)

    def _first_step(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Optional[int]:
        first = self.first_nonfinite
        if first is None:
            first = torch.full((), math.inf, device=trainer.strategy.root_device)
        first = trainer.strategy.reduce(first.clone(), reduce_op="min") if trainer.world_size > 1 else first
        return int(first.item()) if torch.isfinite(first) else None

    def last_good_checkpoint(self, trainer: L.Trainer) -> str:
        """Every save went through on_save_checkpoint, so the newest checkpoint is a finite one."""
        dirs = {cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)}
        found = sorted((p for d in dirs for p in candidates(d)), key=lambda p: p.stat().st_mtime, reverse=True)
        if found:
            step = f" (saved at step {self._last_saved_step})" if self._last_saved_step is not None else ""
            return f"The last good checkpoint: {found[0]}{step}."
        if trainer.ckpt_path:
            return f"This run saved no checkpoint; it started from {trainer.ckpt_path}."
        return "No checkpoint was saved before it."

    def _diverged(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        what: str,
        force_stop: bool = False,
        saving: bool = False,
    ) -> None:
        """Every rank calls this together (the decision was reduced), so the collective below is safe."""
        first = self._first_step(trainer, pl_module)
        self.first_nonfinite = None
        since = f"first non-finite train loss at step {first}" if first is not None else "train loss finite"
        if self.action == "skip" and not force_stop:
            skipped = int(self.skipped.item()) if self.skipped is not None else 0
            if trainer.is_global_zero:
                log.warning(
                    f"Non-finite train loss at step {first} (checked at step {trainer.global_step}); "
                    f"{skipped} optimizer update(s) with non-finite gradients skipped so far "
                    f"(callbacks.divergence.action=skip)."
                )
            return
        now = "not saving a checkpoint; " if saving else ""
        message = (
            f"Training diverged at step {trainer.global_step}: {what} ({since}); {now}stopped. "
            f"{self.last_good_checkpoint(trainer)} {ADVICE}."
        )
        raise DivergenceError(message)
