"""What every model here shares: a train loss normalised by the targets of the whole optimizer step
(so 1 x 8, 2 x 4 and 1 x 4 x accumulation 2 optimise the same loss), epoch metrics synced over
ranks, and an optimizer whose LR can follow the global batch size."""

from __future__ import annotations

import functools
import inspect
import logging
import math
import warnings
from typing import Any, Callable, Optional

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities.enums import GradClipAlgorithmType
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.profiler import record_function

from src.core.metrics import epoch_values
from src.parallel import capabilities
from src.utils.config import ConfigError
from src.utils.logging import TRAIN_LOSS_REDUCE

log = logging.getLogger(__name__)

# Our epoch metrics come from torchmetrics and are already reduced over all ranks; Lightning cannot
# know that and suggests sync_dist=True, which would reduce them a second time.
warnings.filterwarnings("ignore", message=r".*self\.log\('(val|test)/", category=PossibleUserWarning)

LR_SCALING = ("none", "linear", "sqrt")


def scaled_lr(lr: float, rule: str, global_batch_size: int, base_batch_size: int) -> float:
    """The LR for `global_batch_size`, given `lr` tuned at `base_batch_size`.

    linear: Goyal et al. 2017 ("Accurate, Large Minibatch SGD"): k times the batch, k times the LR.
    sqrt: keeps the gradient-noise scale constant; often the better rule for Adam.
    """
    if rule not in LR_SCALING:
        raise ValueError(f"model.lr_scaling={rule!r}: use one of {', '.join(LR_SCALING)}.")
    ratio = global_batch_size / base_batch_size
    return lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


class LitModule(L.LightningModule):
    # True: the module keys its dropout masks and syncs its metrics itself; else src/callbacks/user_module.py does
    exact_by_itself = False

    def __init__(
        self,
        optimizer: Optional[Callable[..., torch.optim.Optimizer]],
        scheduler: Optional[Callable[..., Any]],
        weight_decay: float,
        lr_scaling: str,
        base_batch_size: int,
    ) -> None:
        super().__init__()
        scaled_lr(1.0, lr_scaling, 1, 1)  # validate the rule now, not at the first step
        self.optimizer_fn, self.scheduler_fn, self.weight_decay = optimizer, scheduler, weight_decay
        self.lr_scaling, self.base_batch_size = lr_scaling, base_batch_size
        self._loss_sum: Optional[torch.Tensor] = None
        self._step_totals: Optional[tuple[Any, Any, int]] = None  # (key, targets per step, data ranks)

    @property
    def automatic_optimization(self) -> bool:
        """Lightning runs backward and the optimizer step, unless the module turned that off or its strategy runs the
        whole step itself (capabilities' `own_loss`: the pipeline)."""
        try:
            owned = capabilities.of(self.trainer.strategy).own_loss is not None
        except RuntimeError:  # not attached to a Trainer
            owned = False
        return super().automatic_optimization and not owned

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        L.LightningModule.automatic_optimization.fset(self, value)

    def blocks(self) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
        """The model's repeated blocks as (parent, name, block): the units FSDP shards and checkpoints."""
        return []

    def network(self) -> torch.nn.Module:
        """The module whose forward every step (and generation) calls: FSDP's root unit."""
        return self

    def networks(self) -> list[torch.nn.Module]:
        """Every network a step runs: network(), then frozen ones that never train (a reference policy).
        Strategies shard each alike; blocks() lists the blocks of all of them."""
        return [self.network()]

    def wrappers(self) -> dict[str, Any]:
        """The per-block switches src/parallel/parallelize.py applies (activation_checkpointing, compile,
        compile_mode)."""
        return {}

    def configure_model(self) -> None:
        """Nothing: sharding is applied from outside, by src/parallel/parallelize.py (Lightning requires the hook).
        A model built on the meta device materialises itself here or in `materialize`."""

    def materialize(self, device: torch.device, sharded: bool) -> None:
        """Give a model built on the meta device its values (the FSDP2 strategy calls it after fully_shard).
        Nothing here: only models that defer their init override it."""

    def token_mean_loss(self, loss_sum: torch.Tensor, n_targets: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """The micro-batch's share of its optimizer step's loss, the mean over the step's targets (a language
        model's target tokens, a classifier's labels) on all ranks and accumulation micro-batches (the idea of
        transformers' `num_items_in_batch`).

        Returned to Lightning, which divides it by A (accumulation); DDP and FSDP average the gradients
        over the W ranks. So we return (sum of this micro-batch's target losses) x W x A / N_step, and
        the step's gradient is that of (sum of all its target losses) / N_step, whatever W and A are.
        N_step comes from a table every rank computes alike (see step_total): no communication, no
        host sync. Without a table (the train set cannot count its targets), the micro-batch's own mean.
        """
        total = self.step_total(batch_idx)
        if total is None:
            return loss_sum / n_targets.clamp(min=1)
        world = self._step_totals[2]
        return loss_sum * (world * self.trainer.accumulate_grad_batches / max(total, 1))

    def sequence_mean_loss(self, loss_sum: torch.Tensor, n_sequences: int, batch_idx: int) -> torch.Tensor:
        """As token_mean_loss, over the step's sequences instead of its targets: (sum over this micro-batch's
        b sequences) x W x A / (b x W x the step's micro-batches) = x A / (b x its micro-batches), W cancelling (the
        epoch's last step may have fewer than A micro-batches, as Lightning runs it)."""
        accumulate = self.trainer.accumulate_grad_batches
        left = self.trainer.num_training_batches - (batch_idx // accumulate) * accumulate
        in_step = min(accumulate, left) if math.isfinite(left) else accumulate
        return loss_sum * (accumulate / (n_sequences * in_step))

    def loss_for_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """What training_step returns for `loss`: Lightning divides it by A (accumulation), and DeepSpeed,
        the strategy that "handles accumulation", divides by its gradient_accumulation_steps (= A) once
        more in engine.backward; so under DeepSpeed we multiply by A to leave one division."""
        trainer = self.trainer
        if trainer.strategy.handles_gradient_accumulation and trainer.accumulate_grad_batches > 1:
            return loss * trainer.accumulate_grad_batches
        return loss

    def step_total(self, batch_idx: int) -> Optional[int]:
        """Targets of the optimizer step that `batch_idx` belongs to, over all ranks and micro-batches: the
        datamodule's table for the epoch (`step_targets`), None for data that cannot count its targets.
        `batch_idx` counts on from a mid-epoch checkpoint, as the sampler skips the batches done."""
        trainer = self.trainer
        datamodule = trainer.datamodule
        epoch, accumulate = trainer.current_epoch, trainer.accumulate_grad_batches
        key = (id(datamodule), epoch, accumulate)
        if self._step_totals is None or self._step_totals[0] != key:
            table = datamodule.step_targets(epoch, accumulate) if hasattr(datamodule, "step_targets") else None
            if table is None:
                return None
            self._step_totals = (key, *table)  # numpy: 8 bytes a step
        return int(self._step_totals[1][batch_idx // accumulate])

    def log_train_loss(self, loss: torch.Tensor, batch_idx: int) -> None:
        """Log the step's loss: the sum over its micro-batches of `loss` / A, averaged over ranks.

        With `token_mean_loss` that is the mean over the step's targets on all ranks; with per-micro-batch
        means, the mean of those means. One all-reduce on logging steps only; other steps just add on the
        device (no host sync). Lightning's `self.log(..., sync_dist=True)` would all-reduce on every step, and
        logging without it shows rank 0's own loss, which is not the loss of the global batch. Riding along in
        the same all-reduce: the module's other sums of the step (`take_step_sums`, turned into means by
        train_metrics), and what a callback watching the loss returns (`watch_step_loss`, the divergence check's).
        """
        trainer = self.trainer
        share = loss.detach() / trainer.accumulate_grad_batches  # what Lightning backpropagates
        self._loss_sum = share if self._loss_sum is None else self._loss_sum + share
        if (batch_idx + 1) % trainer.accumulate_grad_batches:  # mid-accumulation: the step is not over
            return
        step_loss, self._loss_sum = self._loss_sum, None
        step, sums = trainer.global_step + 1, self.take_step_sums()
        logging = step % trainer.log_every_n_steps == 0
        watchers = [c for c in trainer.callbacks if hasattr(c, "watch_step_loss")]
        riders = [watcher.watch_step_loss(step_loss, step, logging) for watcher in watchers]
        if not logging:
            return
        values = torch.stack([step_loss, *(r.to(step_loss.dtype) for r in riders)])
        if sums is not None:  # a mean of sums over a mean of counts: the ratio of the totals
            values = torch.cat([values, sums.to(values.dtype)])
        with record_function(TRAIN_LOSS_REDUCE):
            reduced = trainer.strategy.reduce(values, reduce_op="mean")
        for watcher, mean in zip(watchers, reduced[1:]):
            watcher.step_loss_reduced(mean)
        extra = (reduced[1 + len(watchers) :],) if sums is not None else ()
        self.log_dict(self.train_metrics(reduced[0], *extra), prog_bar=True, sync_dist=False)  # reduced above

    def take_step_sums(self) -> Optional[torch.Tensor]:
        """The module's other sums of the optimizer step that just ended (a vector, a count last), taken: reduced
        with the loss on logging steps and handed to train_metrics. None (the default): none."""
        return None

    def train_metrics(self, loss: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"train/loss": loss}

    def log_epoch_metrics(self, stage: str, metrics: Any) -> dict[str, torch.Tensor]:
        """Log `metrics`' values over all ranks (src/core/metrics.py epoch_values), and reset them."""
        values = epoch_values(stage, metrics)
        self.log_dict(values, prog_bar=stage == "val", sync_dist=False)  # compute() synced them
        return values

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: Optional[float] = None,
        gradient_clip_algorithm: Optional[str] = None,
    ) -> None:
        """Clip gradients for fused optimizers under AMP too (our AdamW is fused by default).

        Lightning's AMP plugin refuses to clip when the optimizer unscales inside its own step, as
        torch's fused AdamW does, because under fp16 the gradients are still scaled at that point.
        bf16 has no scaler, so clipping is exact as is; under fp16 we unscale first, and
        GradScaler.step then sees that the gradients are unscaled and does not unscale them again.
        """
        plugin = self.trainer.precision_plugin
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)
        if not (gradient_clip_val and fused and isinstance(plugin, MixedPrecision)):
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if plugin.scaler is not None:
            plugin.scaler.unscale_(optimizer)
        algorithm = GradClipAlgorithmType(gradient_clip_algorithm or GradClipAlgorithmType.NORM)
        Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)

    def configure_optimizers(self) -> Any:
        if self.optimizer_fn is None:
            raise ValueError("model.optimizer is not set; see conf/model/.")
        # Weight decay on matrices and conv kernels only: biases and norm gains are not decayed.
        params = [p for p in self.parameters() if p.requires_grad]
        matrix = {id(p) for p in params if len(getattr(p, "ds_shape", p.shape)) >= 2}  # ZeRO-3: p is a placeholder
        groups = [
            {"params": [p for p in params if id(p) in matrix], "weight_decay": self.weight_decay, "name": "decay"},
            {"params": [p for p in params if id(p) not in matrix], "weight_decay": 0.0, "name": "no_decay"},
        ]
        # an empty group (an adapter trains matrices only) is left out: DeepSpeed's ZeRO optimizer drops it, and the LR
        # schedule, made on the groups given here, would then step one group more than the optimizer has
        groups = [group for group in groups if group["params"]]
        base_lr = lr = self.optimizer_fn.keywords["lr"]
        if self.lr_scaling != "none":
            global_batch = getattr(self.trainer.datamodule, "global_batch_size", None)
            if global_batch is None:
                raise ConfigError(
                    f"model.lr_scaling={self.lr_scaling} scales the LR by the data's global batch, and "
                    f"{type(self.trainer.datamodule).__name__} has no global_batch_size: set model.lr_scaling=none."
                )
            lr = scaled_lr(base_lr, self.lr_scaling, global_batch, self.base_batch_size)
            log.info(
                f"LR {base_lr:g} at batch {self.base_batch_size} -> {lr:g} at global batch {global_batch} "
                f"({self.lr_scaling} scaling)"
            )
        make = self.optimizer_fn
        replacement = capabilities.of(self.trainer.strategy).optimizer_class  # e.g. DeepSpeed's CPU Adam for offload
        if replacement is not None:
            accepted = inspect.signature(replacement).parameters
            make = functools.partial(replacement, **{k: v for k, v in make.keywords.items() if k in accepted})
            log.info(f"{make.func.__name__} replaces {self.optimizer_fn.func.__name__}, as the strategy requires")
        optimizer = make(groups, lr=lr)
        if self.scheduler_fn is None:
            return optimizer
        steps = self.trainer.estimated_stepping_batches
        if not math.isfinite(steps):
            raise ValueError("The LR schedule needs a finite length: set trainer.max_steps (or trainer.max_epochs).")
        scheduler = self.scheduler_fn(optimizer, num_training_steps=int(steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
