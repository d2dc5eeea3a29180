"""A small CNN with BatchNorm: the vision path, and the model that SyncBatchNorm matters for."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from src.core.module import LitModule
from src.utils.labels import IGNORE_INDEX


def conv_block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


class ConvNetLitModule(LitModule):
    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        channels: tuple[int, ...] = (16, 32),
        optimizer: Optional[Callable[..., torch.optim.Optimizer]] = None,
        scheduler: Optional[Callable[..., Any]] = None,
        weight_decay: float = 0.0,
        lr_scaling: str = "none",
        base_batch_size: int = 64,
    ) -> None:
        super().__init__(optimizer, scheduler, weight_decay, lr_scaling, base_batch_size)
        blocks, c = [], in_channels
        for width in channels:
            blocks += [conv_block(c, width), nn.MaxPool2d(2, ceil_mode=True)]
            c = width
        self.features = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, num_classes))

        # Sample-weighted loss and accuracy whose sums and counts torchmetrics syncs over ranks; label
        # IGNORE_INDEX (a padding sample, where a datamodule pads evaluation: src/core/datamodule.py) counts in
        # neither; a NaN loss (a diverged model) stays NaN instead of being dropped (the divergence callback reads
        # it). Not nan_strategy="disable": torchmetrics then replaces the weights by ones.
        def make() -> nn.ModuleDict:
            return nn.ModuleDict(
                {
                    "loss": MeanMetric(nan_strategy=float("nan")),
                    "acc": MulticlassAccuracy(num_classes, average="micro", ignore_index=IGNORE_INDEX),
                }
            )

        self.val_metrics, self.test_metrics = make(), make()

    def blocks(self) -> list[tuple[nn.Module, str, nn.Module]]:
        return [(self.features, name, b) for name, b in self.features.named_children() if isinstance(b, nn.Sequential)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log_train_loss(loss, batch_idx)
        return self.loss_for_backward(loss)  # DeepSpeed divides by the accumulation once more than Lightning

    def _eval_step(self, batch: tuple[torch.Tensor, torch.Tensor], metrics: nn.ModuleDict) -> None:
        x, y = batch
        logits = self(x)
        n = (y != IGNORE_INDEX).sum()
        # a sum over the real samples (0 for an all-padding batch, where a mean would be 0/0)
        loss_sum = nn.functional.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")
        metrics["loss"].update(loss_sum / n.clamp(min=1), weight=n)
        metrics["acc"].update(logits, y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.val_metrics)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.test_metrics)

    def on_validation_epoch_end(self) -> None:
        self.log_epoch_metrics("val", self.val_metrics)

    def on_test_epoch_end(self) -> None:
        self.log_epoch_metrics("test", self.test_metrics)
