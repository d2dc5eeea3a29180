"""callbacks.comm: the collectives of one training step, read from torch.profiler, as MiB on the wire.

Off by default (`every_n_steps: 0`); `python train.py trainer=fsdp callbacks.comm.every_n_steps=100` profiles
steps 100, 200, ... (never step 0: DDP rebuilds its buckets and FSDP2 initialises lazily there) and logs rank 0's
`train/comm_mib_per_step/<collective>` and `.../total` to TensorBoard. `python -m bench.scale.comm` runs a config on N gloo
ranks with this callback on every step and prints the collectives against the ZeRO paper's and Megatron's formulas.

What is read: each `c10d::` op the step issues (the collective as the caller asked for it: DDP's bucket
all-reduce, FSDP2's all-gather and reduce-scatter, a send) with its phase, and the backend's own event for
its size and dtype when the op records no shapes (`gloo:all_reduce [[1001000]] float`). The two differ where
a backend implements a collective by another: gloo's reduce-scatter is an all-reduce of the whole input,
then a copy of the rank's part. Bytes are those of the ring algorithm for the collective asked for, per rank,
S elements of a group of n ranks: all-reduce 2(n-1)/n·S, reduce-scatter and all-gather (n-1)/n·S (S the
unsharded size), broadcast and reduce (n-1)/n·S, send S, recv 0 (it receives S), barrier 0. n comes from the
shapes for all-gather and reduce-scatter; the profiler does not record which group other collectives use, so
they count with n = the world size (an all-reduce within a smaller group is then overstated).

Phases: `forward` from the step's start to the backward (the loss included), `backward`, `optimizer` from
`on_before_optimizer_step` to the step's end (clipping, the optimizer's own collectives), `logging` inside the
`TRAIN_LOSS_REDUCE` range (the train-loss all-reduce on logging steps), `other` for the rest. Under trainer=pipeline
(manual optimization) forward and backward are the pipelining schedule's own `Forward i` / `Backward i` / `PP:`
ranges, and the gradient sync and clipping before the optimizer step count as `other`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, NamedTuple, Optional

import lightning as L
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from src.parallel import expert_parallel
from src.utils.config import check_number
from src.utils.logging import TRAIN_LOSS_REDUCE

PHASE = "comm:"  # prefix of the phase ranges this callback opens
BYTES = {
    "float": 4,
    "double": 8,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "unsigned char": 1,
    "signed char": 1,
    "bool": 1,
}
DTYPE = {
    "float": "fp32",
    "double": "fp64",
    "c10::BFloat16": "bf16",
    "c10::Half": "fp16",
    "long int": "int64",
    "int": "int32",
    "unsigned char": "uint8",
    "bool": "bool",
}
# c10d op -> (the collective, the backend event that runs it when the op records no shapes: TensorList ops)
OPS = {
    "allreduce_": "all_reduce",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "broadcast_": "broadcast",
    "reduce_": "reduce",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "barrier": "barrier",
    "alltoall_base_": "all_to_all",
    "gather_": "gather",
    "scatter_": "scatter",
}
PIPELINE = re.compile(r"^(Forward|Backward) \d+$|^PP:")  # torch.distributed.pipelining's ranges


def ring_bytes(op: str, elements: int, element_size: int, n: int) -> float:
    """Bytes one rank sends for `op` on S = `elements` in a group of n by the ring algorithm (see the module doc)."""
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_gather": (n - 1) / n,
        "broadcast": (n - 1) / n,
        "reduce": (n - 1) / n,
        "all_to_all": (n - 1) / n,
        "gather": (n - 1) / n,
        "scatter": (n - 1) / n,
        "send": 1.0,
    }.get(op, 0.0)
    return factor * elements * element_size


def _numel(shape: list) -> int:
    return int(torch.Size(shape).numel())


def _phase(start: int, ranges: list[tuple[str, float, float]]) -> str:
    """The phase of an op starting at `start`: logging beats a pipeline range beats this callback's phases."""
    found = [name for name, a, b in ranges if a <= start <= b]
    for name in ("logging", "forward", "backward"):
        if name in found:
            return name
    return found[0] if found else "other"


class Event(NamedTuple):
    name: str
    start: int  # ns
    end: int
    shapes: list
    dtypes: list


def trace(prof: profile) -> list[Event]:
    """The profile's events, read from kineto's results as they are: `prof.events()` builds a FunctionEvent tree
    first, 0.1-0.5 s a step for the tiny model's ~2,600 events on this CPU, this takes 5 ms. `kineto_results` and
    its events' methods are not documented: tests/test_comm.py fails by name if torch changes them."""
    return [
        Event(e.name(), e.start_ns(), e.end_ns(), e.shapes(), e.dtypes()) for e in prof.profiler.kineto_results.events()
    ]


def _sorted_out(events: list[Event]) -> tuple[list[tuple[str, int, int]], list[Event], list[Event]]:
    """`events` in start order, sorted out: the phase ranges (this callback's, the pipeline's, the logged loss's
    reduction), the c10d collectives, and the backend's (gloo, nccl, mpi) events that carry their sizes."""
    ranges, ops, backend = [], [], []
    for e in sorted(events, key=lambda e: e.start):
        name, start = e.name, e.start
        if name.startswith(PHASE) or name == TRAIN_LOSS_REDUCE:
            ranges.append(("logging" if name == TRAIN_LOSS_REDUCE else name[len(PHASE) :], start, e.end))
        elif PIPELINE.match(name):
            kind = "backward" if name.startswith("Backward") or re.search(r"(B|W|_B)\d+$", name) else "forward"
            ranges.append((kind, start, e.end))
        elif name.startswith("c10d::") and name[6:] in OPS:
            ops.append(e)
        elif re.match(r"^(gloo|nccl|mpi):", name):
            backend.append(e)
    return ranges, ops, backend


def _backend_event(op: Event, kind: str, in_n: Optional[int], backend: list[Event], claimed: set[int]) -> Optional[int]:
    """The first unclaimed backend event at or after `op` that fits it: of the op's input size `in_n` where the op
    has shapes (None: it has none), else of its kind by name."""
    for i, b in enumerate(backend):
        if i in claimed or b.start < op.start:
            continue
        size = _numel(b.shapes[0]) if b.shapes else 0
        if (size == in_n) if in_n is not None else b.name.split(":", 1)[1] == kind:
            return i
    return None


def collectives(events: list[Event], world: int) -> list[dict[str, Any]]:
    """One dict per collective in `events` (see `trace`), in issue order."""
    ranges, ops, backend = _sorted_out(events)
    claimed: set[int] = set()
    out = []
    for op in ops:
        kind = OPS[op.name[6:]]
        if kind == "barrier":  # synchronises, sends no payload
            out.append(
                {
                    "op": kind,
                    "phase": _phase(op.start, ranges),
                    "elements": 0,
                    "dtype": "-",
                    "group": world,
                    "bytes": 0.0,
                }
            )
            continue
        shaped = [s for s, t in zip(op.shapes, op.dtypes) if s and t != "ScalarList"]
        if shaped:  # output, input (all-gather, reduce-scatter): the sizes are the op's own
            out_n, in_n = _numel(shaped[0]), _numel(shaped[-1])
            dtype = op.dtypes[0]
        match = _backend_event(op, kind, in_n if shaped else None, backend, claimed)
        if match is not None:
            claimed.add(match)
        if shaped and kind in ("all_gather", "reduce_scatter"):
            elements, n = max(out_n, in_n), max(out_n, in_n) // max(min(out_n, in_n), 1)
        elif match is not None:
            b = backend[match]
            per_rank = _numel(b.shapes[0]) if b.shapes else 1
            dtype, n = (b.dtypes or ["float"])[0], world
            elements = per_rank * world if kind == "all_gather" else per_rank
        else:
            continue  # nothing to size it by (not seen in the templates' strategies)
        size = BYTES.get(dtype, 4)
        out.append(
            {
                "op": kind,
                "phase": _phase(op.start, ranges),
                "elements": elements,
                "dtype": DTYPE.get(dtype, dtype),
                "group": n,
                "bytes": ring_bytes(kind, elements, size, n),
            }
        )
    return out


class CommVolume(L.Callback):
    """Profile one optimizer step every `every_n_steps` (0: off) and log the MiB each collective sent.

    `save_dir`: also write each rank's collectives as JSON lines to `<save_dir>/rank<r>.jsonl` (bench/scale/comm.py).
    """

    def __init__(self, every_n_steps: int = 0, save_dir: Optional[str] = None) -> None:
        check_number("callbacks.comm.every_n_steps", every_n_steps, lambda v: v >= 0,
                     "0 (off) or a number of optimizer steps between two profiled steps", integer=True)  # fmt: skip
        self.every, self.save_dir = every_n_steps, save_dir
        self.profiler: Optional[profile] = None
        self.range: Optional[record_function] = None

    def _open(self, phase: Optional[str]) -> None:
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
        if phase is not None and self.profiler is not None:
            self.range = record_function(PHASE + phase)
            self.range.__enter__()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        first_micro_batch = batch_idx % trainer.accumulate_grad_batches == 0
        step = trainer.global_step
        if self.profiler is None and self.every and step and step % self.every == 0 and first_micro_batch:
            self.profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            self.profiler.__enter__()
        if pl_module.automatic_optimization:  # manual (pipeline): the schedule's own ranges say forward / backward
            self._open("forward")

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._open("backward")

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._open(None)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._open("optimizer")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._open(None)
        if self.profiler is None or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        self.profiler.__exit__(None, None, None)
        world = dist.get_world_size() if dist.is_initialized() else 1
        found = collectives(trace(self.profiler), world)
        self.profiler = None
        step = trainer.global_step - 1  # the step just taken
        totals: dict[str, float] = {}
        for c in found:
            totals[c["op"]] = totals.get(c["op"], 0.0) + c["bytes"] / 2**20
        totals["total"] = sum(totals.values())
        for logger in trainer.loggers:  # Lightning's loggers write on rank 0 only
            logger.log_metrics({f"train/comm_mib_per_step/{k}": v for k, v in totals.items()}, step=step)
        if self.save_dir:
            self._save(trainer, pl_module, step, found)

    def _save(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int, found: list[dict]) -> None:
        """One JSON line per profiled step, with what bench/scale/comm.py's formulas need about the model."""
        config = getattr(pl_module, "config", None)
        params = sum(getattr(p, "ds_numel", p.numel()) for p in pl_module.parameters() if p.requires_grad)
        network = pl_module.network() if hasattr(pl_module, "network") else None
        experts = expert_parallel.experts_modules(network) if expert_parallel.ep_plan(config) and network else []
        line = {
            "rank": trainer.global_rank,
            "world": trainer.world_size,
            "step": step,
            "params": params,
            "hidden_size": getattr(config, "hidden_size", None),
            "layers": getattr(config, "num_hidden_layers", None),
            # a mixture-of-experts model's experts (what expert parallelism splits): their modules and parameters
            "moe_layers": len(experts),
            "expert_params": sum(p.numel() for m in experts for p in m.parameters() if p.requires_grad),
            "top_k": getattr(config, "num_experts_per_tok", None),
            "collectives": found,
        }
        path = Path(self.save_dir) / f"rank{trainer.global_rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())
