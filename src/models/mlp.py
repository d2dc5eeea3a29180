"""A classifier for tables: blocks of Linear-BatchNorm-ReLU-Dropout, then a linear head.

The worked example of docs/your-model.md, on LitModule: the loss each step logs and returns goes through the base
class (the step's mean over all ranks, the gradient scaled for DeepSpeed's accumulation), the evaluation metrics are
torchmetrics (sums and counts synced over ranks), and `blocks()` names the units FSDP2 shards.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from src.core.module import LitModule


class MLPLitModule(LitModule):
    def __init__(
        self,
        num_features: int,
        num_classes: int,
        hidden: tuple[int, ...] = (64, 64),
        dropout: float = 0.1,
        optimizer: Optional[Callable[..., torch.optim.Optimizer]] = None,
        scheduler: Optional[Callable[..., Any]] = None,
        weight_decay: float = 0.0,
        lr_scaling: str = "none",
        base_batch_size: int = 32,
    ) -> None:
        super().__init__(optimizer, scheduler, weight_decay, lr_scaling, base_batch_size)
        widths = [num_features, *hidden]
        self.body = nn.Sequential(
            *(
                nn.Sequential(nn.Linear(a, b, bias=False), nn.BatchNorm1d(b), nn.ReLU(), nn.Dropout(dropout))
                for a, b in zip(widths, widths[1:])
            )
        )
        self.head = nn.Linear(widths[-1], num_classes)

        def metrics() -> nn.ModuleDict:  # a loss weighted by each batch's rows, and the accuracy
            return nn.ModuleDict({"loss": MeanMetric(), "acc": MulticlassAccuracy(num_classes, average="micro")})

        self.val_metrics, self.test_metrics = metrics(), metrics()

    def blocks(self) -> list[tuple[nn.Module, str, nn.Module]]:
        return [(self.body, name, block) for name, block in self.body.named_children()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log_train_loss(loss, batch_idx)
        return self.loss_for_backward(loss)

    def evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], metrics: nn.ModuleDict) -> None:
        x, y = batch
        logits = self(x)
        metrics["loss"].update(nn.functional.cross_entropy(logits, y), weight=len(y))
        metrics["acc"].update(logits, y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.evaluate(batch, self.val_metrics)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.evaluate(batch, self.test_metrics)

    def on_validation_epoch_end(self) -> None:
        self.log_epoch_metrics("val", self.val_metrics)

    def on_test_epoch_end(self) -> None:
        self.log_epoch_metrics("test", self.test_metrics)
