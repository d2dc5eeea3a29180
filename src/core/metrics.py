"""An epoch's metrics, written once: each torchmetrics metric's value over all ranks, then reset for the next epoch."""

from __future__ import annotations

from typing import Mapping

import torch
from torchmetrics import Metric


def epoch_values(stage: str, metrics: Mapping[str, Metric]) -> dict[str, torch.Tensor]:
    """`stage/name` -> each metric's value (compute() all-gathers its states, sums and counts, over ranks; a metric
    computing a dict gives `stage/key` for each of its keys); every metric reset after."""
    values: dict[str, torch.Tensor] = {}
    for name, metric in metrics.items():
        value = metric.compute()
        values.update(
            {f"{stage}/{k}": v for k, v in value.items()} if isinstance(value, dict) else {f"{stage}/{name}": value}
        )
        metric.reset()
    return values
