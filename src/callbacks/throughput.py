"""Tokens/s, FLOP/s and MFU on Lightning's `Throughput` (rank 0 logs).

Logged keys: `train/items_per_sec` is tokens/s over all ranks (images/s for image data),
`train/device/items_per_sec` per rank; tokens are the real ones (the attention_mask's ones: a
padded instruction batch's padding is not counted; packed text has no mask, every position counts).
`samples_per_sec` counts sequences; `device/flops_per_sec` uses the model's `flops_of_batch(batch)`
(the convention is in src/lm/features/flops.py: about 6N + attention per real token for full training,
4N with LoRA), or a constant `flops_per_batch` attribute; `device/mfu` divides it by the
device's peak: `peak_flops` from config (e.g. a CPU's measured matmul peak, python -m bench.profile.matmul_peak), else
DENSE_PEAKS below for the H200, else Lightning's table for the GPUs it recognises by name (A100, H100, ...).
`device/peak_memory_mib`
is rank 0's peak: CUDA's max allocated tensor memory on a GPU, the process's peak RSS on a CPU.

No host sync per step. Lightning's ThroughputMonitor synchronizes CUDA after every batch, training
and evaluation, to timestamp it, which stops the host from queueing the next step's kernels while
the GPU works. Here the counts add up every batch (real tokens and FLOPs as device tensors, which
nothing reads until then), and the clock is read, after one
synchronization, on training logging steps, when validation starts and when an evaluation ends.
Training rates are the same arithmetic as Lightning's (work between two readings over the time
between them), with validation time left out; `validate/...` and `test/...` rates cover a whole
evaluation and are logged at its end (Lightning logged them per batch, and only when the batch
happened to fall on a training logging step, i.e. hardly ever).
"""

from __future__ import annotations

import logging
import resource
import time
from typing import Any, Optional

import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.data import extract_batch_size

from src.parallel.samplers import rank_and_world

log = logging.getLogger(__name__)


def _tokens(batch: Any) -> bool:
    return isinstance(batch, dict) and "input_ids" in batch


def _batch_size(batch: Any) -> int:
    """Rows of a token batch; else the samples Lightning finds in any batch (its first tensor's dim 0)."""
    return batch["input_ids"].shape[0] if _tokens(batch) else extract_batch_size(batch)


def peak_memory_mib(device: torch.device) -> float:
    """Reads counters only: no device synchronization."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def wait_for_device(device: torch.device) -> None:
    """Let the device finish its queued work, so that the clock read next includes it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _num_items(batch: Any) -> Any:
    """Real tokens for text batches (a device tensor when there is an attention_mask), samples otherwise."""
    if not _tokens(batch):
        return _batch_size(batch)
    mask = batch.get("attention_mask")
    return batch["input_ids"].numel() if mask is None else mask.sum()


def replica_share(trainer) -> float:
    """The share of a batch's work that one rank does: 1 under data parallelism; 1/K when the K ranks of a
    pipeline (or tensor-parallel) group all read the same batch, so that the rates over all ranks
    (rank 0's times the world size) count each model replica's batches and samples once, and device/mfu a
    device's work."""

    return rank_and_world(trainer)[1] / max(trainer.world_size, 1)


def _scaled(x: Any, share: float) -> Any:
    """x * share without losing exactness: device-side counts are integer tensors, and FLOPs of a batch
    exceed float32's exact integers (2^24), so a float32 product would round them."""
    if share == 1:
        return x
    return x.double() * share if isinstance(x, torch.Tensor) else x * share


def _count(counts: dict, batch: Any, share: float = 1.0) -> None:
    """Add one batch to running counts; shapes and device-side sums only, so nothing waits for the device."""
    counts["batches"] += share  # a pipeline's K ranks run one batch: each counts 1/K of it, as of its samples
    counts["samples"] += _scaled(_batch_size(batch), share)
    counts["items"] += _scaled(_num_items(batch), share)


def _flops(pl_module: Any, batch: Any) -> Any:
    if hasattr(pl_module, "flops_of_batch"):
        return pl_module.flops_of_batch(batch)
    return getattr(pl_module, "flops_per_batch", 0.0)


# trainer.precision -> the dtype the matmuls run in, for the peak FLOP/s of Lightning's table
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "64": torch.float64}


def compute_dtype(precision: str) -> torch.dtype:
    """ "bf16-mixed" -> bfloat16, "16-true" -> float16, "32-true" -> float32, ..."""
    return COMPUTE_DTYPES.get(str(precision).split("-")[0], torch.float32)


# Dense tensor-core peaks (FLOP/s) of GPUs Lightning 2.6.6 gets wrong: torch names an H200 "NVIDIA H200" (or
# "NVIDIA H200 NVL"), which its table matches only as "sxm1"/"nvl1" (so it returns None: no MFU), and its H200
# figures are the datasheet's *with sparsity* (bf16 2.0e15), twice what a dense matmul can reach. Here the NVIDIA H200
# datasheet's figures halved: the dense peaks MFU is conventionally taken against (an H200 SXM's equal the H100
# SXM's, which Lightning's table lists dense). "tfloat32": fp32 matmuls when torch's matmul precision allows TF32.
DENSE_PEAKS = {
    "h200 nvl": {torch.float32: 60e12, "tfloat32": 417.5e12, torch.bfloat16: 835.5e12, torch.float16: 835.5e12},
    "h200": {torch.float32: 67e12, "tfloat32": 494.7e12, torch.bfloat16: 989.4e12, torch.float16: 989.4e12},
}


def dense_peak(device_name: str, dtype: torch.dtype) -> Optional[float]:
    """DENSE_PEAKS' figure for a GPU named `device_name` (torch.cuda.get_device_name) in `dtype`; None for a GPU not
    in it (Lightning's table then decides)."""
    name = device_name.lower()
    chip = next((chip for chip in DENSE_PEAKS if all(word in name for word in chip.split())), None)
    if chip is None:
        return None
    tf32 = dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest"
    return DENSE_PEAKS[chip].get("tfloat32" if tf32 else dtype)


def available_flops(device: torch.device, dtype: torch.dtype) -> Optional[float]:
    """The device's peak FLOP/s in `dtype`: DENSE_PEAKS, else Lightning's table (None for a CPU or an unknown GPU)."""
    if device.type == "cuda":
        peak = dense_peak(torch.cuda.get_device_name(device), dtype)
        if peak is not None:
            return peak
    return get_available_flops(device, dtype)


class TokenThroughputMonitor(Callback):
    """Lightning's ThroughputMonitor, rebuilt on its public engine (`lightning.fabric.utilities.throughput.
    Throughput`) to do what it does not: count real tokens and the model's FLOPs per batch on the device, read the
    clock on logging steps only, and rate each evaluation as a whole (see the module docstring)."""

    def __init__(self, window_size: int = 50, peak_flops: Optional[float] = None) -> None:
        super().__init__()
        self.window_size, self.peak_flops = window_size, peak_flops
        self.available_flops: Optional[float] = None
        self._train: Optional[Throughput] = None
        self._totals = {"batches": 0, "samples": 0, "items": 0}  # training, since it started
        self._pending = {"batches": 0, "samples": 0, "items": 0, "flops": 0.0}  # training, since the last reading
        self._t0, self._steps_seen = 0.0, 0
        self.enabled = True
        self._start_eval()

    def setup(self, trainer, pl_module, stage: str) -> None:
        # a batch of prompts (model/objective=grpo) holds no tokens yet: its work is the sampling's, not counted here
        self.enabled = getattr(trainer.datamodule, "batch_kind", "tokens") != "prompts"
        if not self.enabled:
            log.info("callbacks.throughput: not measured for batches of prompts (their completions are sampled)")
        # peak_flops overrides the tables (which have no CPUs)
        device, dtype = trainer.strategy.root_device, compute_dtype(trainer.precision)
        self.available_flops = self.peak_flops or available_flops(device, dtype)
        readings = max(2, round(self.window_size / max(1, trainer.log_every_n_steps)) + 1)  # one per logging step
        self._train = Throughput(
            available_flops=self.available_flops, world_size=trainer.world_size, window_size=readings
        )

    @rank_zero_only
    def on_train_start(self, trainer, *args: Any) -> None:
        if not self.enabled:
            return
        self._train.reset()
        self._totals = dict.fromkeys(self._totals, 0)
        self._pending = dict.fromkeys(self._pending, 0)
        self._t0, self._steps_seen = time.perf_counter(), trainer.global_step

    @rank_zero_only
    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, *args: Any) -> None:
        if not self.enabled:
            return
        share = replica_share(trainer)
        _count(self._pending, batch, share)
        self._pending["flops"] += _scaled(_flops(pl_module, batch), share)
        stepped, self._steps_seen = trainer.global_step > self._steps_seen, trainer.global_step
        if not stepped or trainer.global_step % max(1, trainer.log_every_n_steps):  # mid-step, or not a logging step
            return
        self._read_clock(trainer)
        # logged at the step Lightning logs this step's train/loss at (the steps completed before it)
        self._log(trainer, {f"train/{k}": v for k, v in self._train.compute().items()}, trainer.global_step - 1)
        self._log(trainer, {"train/device/peak_memory_mib": peak_memory_mib(trainer.strategy.root_device)})

    @rank_zero_only
    def on_validation_start(self, trainer, *args: Any) -> None:
        if not self.enabled:
            return
        if trainer.sanity_checking:
            return
        if trainer.state.fn == TrainerFn.FITTING:
            self._read_clock(trainer)  # the training steps since the last logging step, before the pause
        self._start_eval()

    @rank_zero_only
    def on_validation_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
        if not self.enabled:
            return
        if not trainer.sanity_checking:
            _count(self._eval, batch, replica_share(trainer))

    @rank_zero_only
    def on_validation_end(self, trainer, *args: Any) -> None:
        if not self.enabled:
            return
        if trainer.sanity_checking:
            return
        seconds = self._end_eval(trainer, "validate")
        if trainer.state.fn == TrainerFn.FITTING:
            self._t0 += seconds  # the training clock does not run during validation

    @rank_zero_only
    def on_test_start(self, trainer, *args: Any) -> None:
        if not self.enabled:
            return
        self._start_eval()

    @rank_zero_only
    def on_test_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
        if not self.enabled:
            return
        _count(self._eval, batch, replica_share(trainer))

    @rank_zero_only
    def on_test_end(self, trainer, *args: Any) -> None:
        if not self.enabled:
            return
        self._end_eval(trainer, "test")

    def _start_eval(self) -> None:
        self._eval = {"batches": 0, "samples": 0, "items": 0}
        self._eval_t0 = time.perf_counter()

    def _end_eval(self, trainer, stage: str) -> float:
        """Log the evaluation's rates (one sync); return its duration."""
        wait_for_device(trainer.strategy.root_device)
        seconds = time.perf_counter() - self._eval_t0
        if self._eval["batches"]:
            counts = {key: float(count) for key, count in self._eval.items()}
            metrics = {f"{stage}/device/{key}_per_sec": count / seconds for key, count in counts.items()}
            if trainer.world_size > 1:  # as Lightning: rank 0's rate times the ranks
                metrics.update(
                    {f"{stage}/{key}_per_sec": count / seconds * trainer.world_size for key, count in counts.items()}
                )
            self._log(trainer, metrics)
        return seconds

    def _read_clock(self, trainer) -> None:
        """Record the work done since the last reading, and the time it took: the one host sync."""
        pending = self._pending
        if not pending["batches"]:
            return
        wait_for_device(trainer.strategy.root_device)
        totals = self._totals  # Throughput takes running totals
        totals["batches"] += pending["batches"]
        totals["samples"] += pending["samples"]
        totals["items"] += int(pending["items"])  # read after the sync: no extra wait
        self._train.update(
            time=time.perf_counter() - self._t0,
            batches=totals["batches"],
            samples=totals["samples"],
            lengths=totals["items"],
            flops=float(pending["flops"]) or None,
        )
        self._pending = dict.fromkeys(pending, 0)

    @staticmethod
    def _log(trainer, metrics: dict[str, float], step: Optional[int] = None) -> None:
        # Python floats straight to the loggers: self.log would put each in a device tensor, and a host-to-GPU
        # copy from pageable memory waits for the stream.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step if step is None else step)
