"""Tokens/s (and MFU where the peak FLOP/s of the device is known) through Lightning's ThroughputMonitor.

Logged keys: `train/items_per_sec` is tokens/s over all ranks (images/s for image data),
`train/device/items_per_sec` per rank; `samples_per_sec` counts sequences; `mfu` appears on GPUs
Lightning knows the peak of.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ThroughputMonitor


def _inputs(batch: Any) -> Any:
    return batch["input_ids"] if isinstance(batch, dict) else batch[0]


def _batch_size(batch: Any) -> int:
    return _inputs(batch).shape[0]


def _num_items(batch: Any) -> int:
    """Tokens for text batches, samples otherwise."""
    return _inputs(batch).numel() if isinstance(batch, dict) else _batch_size(batch)


class TokenThroughputMonitor(ThroughputMonitor):
    def __init__(self, window_size: int = 50) -> None:
        super().__init__(batch_size_fn=_batch_size, length_fn=_num_items, window_size=window_size)
