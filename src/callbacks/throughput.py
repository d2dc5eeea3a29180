"""Tokens/s, FLOP/s and MFU through Lightning's ThroughputMonitor (rank 0 logs).

Logged keys: `train/items_per_sec` is tokens/s over all ranks (images/s for image data),
`train/device/items_per_sec` per rank; `samples_per_sec` counts sequences; `device/flops_per_sec`
uses the model's `flops_per_batch` (6N + attention per token); `device/mfu` divides it by the
device's peak: Lightning's table for known GPUs (A100, H100, H200, ...), or `peak_flops` from
config, e.g. a CPU's measured matmul peak (python -m bench.matmul_peak). `device/peak_memory_mib`
is rank 0's peak: CUDA's max allocated tensor memory on a GPU, the process's peak RSS on a CPU.
"""

from __future__ import annotations

import resource
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.utilities import rank_zero_only


def _inputs(batch: Any) -> Any:
    return batch["input_ids"] if isinstance(batch, dict) else batch[0]


def _batch_size(batch: Any) -> int:
    return _inputs(batch).shape[0]


def peak_memory_mib(device: torch.device) -> float:
    """Reads counters only: no device synchronization."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _num_items(batch: Any) -> int:
    """Tokens for text batches, samples otherwise."""
    return _inputs(batch).numel() if isinstance(batch, dict) else _batch_size(batch)


class TokenThroughputMonitor(ThroughputMonitor):
    def __init__(self, window_size: int = 50, peak_flops: Optional[float] = None) -> None:
        super().__init__(batch_size_fn=_batch_size, length_fn=_num_items, window_size=window_size)
        self.peak_flops = peak_flops
        self._memory_logged_at = -1

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.peak_flops:  # overrides Lightning's table (which has no CPUs)
            self.available_flops = self.peak_flops
            for throughput in self._throughputs.values():
                throughput.available_flops = self.peak_flops

    @rank_zero_only
    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, *args: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, *args)
        step = trainer.global_step
        # Once per logging step; under gradient accumulation this hook runs for every micro-batch.
        if step == 0 or step % trainer.log_every_n_steps or step == self._memory_logged_at:
            return
        # A Python float straight to the loggers: self.log would put it in a device tensor every step,
        # and a host-to-GPU copy from pageable memory waits for the stream.
        memory = {"train/device/peak_memory_mib": peak_memory_mib(trainer.strategy.root_device)}
        for logger in trainer.loggers:
            logger.log_metrics(memory, step=step)
        self._memory_logged_at = step
