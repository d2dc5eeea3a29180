"""Lightning's epoch-end habit, made exact or named: predictions collected in `validation_step` and reduced in
`on_validation_epoch_end` (Lightning's docs since 2.0). On N ranks each rank holds only the rows of its shard.

- `self.all_gather(rows)` in an epoch-end hook (`RowsInOrder`): Lightning stacks equal shapes into (world, ...) and
  gloo aborts on uneven ones (61 rows on 2 ranks: 31 and 30). Here a tensor whose dim 0 is this loop's rows on every
  rank (as many as the rank's batches of this epoch held) comes back as every rank's rows in dataset order, the
  tensor 1 process gathers (Lightning returns it unchanged there): the ranks' shards interleave (rank r holds samples
  r, r + W, ... of an evaluation split, and positions r, r + W, ... of the epoch's training order: gather_shards),
  so row i of the result is sample i. Any other tensor, and any gather outside an epoch-end hook (a training step's
  batch), keeps Lightning's (world, ...) stacking; shapes that differ between ranks are one sentence.
- `self.log(name, value)` from an epoch-end hook (`PerRankValues`): where the ranks' values differ, each rank computed
  it from its own shard and their mean is not the split's value that 1 process logs. Named in one warning before step
  1 (the sanity validation runs the hook); refused in one sentence where it is the monitored or optimized metric
  (checkpoint selection, early stopping and sweeps would read it). After an all_gather the ranks agree: nothing said.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection

from src.parallel.gather import gather_shards
from src.utils.config import ConfigError

log = logging.getLogger(__name__)


class RowsInOrder:
    """A module's `all_gather` (module doc). `rows()`: in an epoch-end hook, the rows this rank's batches held in that
    loop's epoch; None elsewhere (a training step's gather of its batch keeps Lightning's stacking)."""

    def __init__(self, all_gather: Callable[..., Any], rows: Callable[[], Optional[int]], trainer: Callable[[], Any]):
        self.all_gather, self.rows, self.trainer = all_gather, rows, trainer

    def __call__(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        if self.rows() is None or group is not None or not dist.is_initialized() or dist.get_world_size() == 1:
            return self.all_gather(data, group, sync_grads)
        return apply_to_collection(data, torch.Tensor, self.gather, sync_grads)

    def gather(self, tensor: torch.Tensor, sync_grads: bool) -> torch.Tensor:
        world = dist.get_world_size()
        shapes: list = [None] * world
        dist.all_gather_object(shapes, (tuple(tensor.shape), self.rows()))
        if tensor.ndim and all(shape[1:] == tensor.shape[1:] and shape[0] == rows for shape, rows in shapes):
            return gather_shards(tensor, sum(rows for _, rows in shapes), self.trainer())  # the ranks' rows interleaved
        if any(shape != shapes[0][0] for shape, _ in shapes):
            raise ConfigError(
                f"self.all_gather got tensors of shapes {[list(s) for s, _ in shapes]} on the {world} ranks, which "
                "can be gathered only as the epoch's rows (dim 0: as many rows as the rank's batches held this "
                "epoch): gather the rows collected from the batches, or pad each tensor to one shape."
            )
        return self.all_gather(tensor, None, sync_grads)  # not the epoch's rows: Lightning's stacking


class PerRankValues:
    """Checks a value logged from an epoch-end hook (module doc): `monitored()` names the metrics something selects
    by; warns or refuses once per name."""

    def __init__(self, monitored: Callable[[], Iterable[str]]) -> None:
        self.monitored = monitored
        self.named: set[str] = set()

    def check(self, hook: str, name: str, value: Any) -> None:
        if name in self.named or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        if isinstance(value, torch.Tensor) and value.numel() != 1 or not isinstance(value, (torch.Tensor, int, float)):
            return  # (a metric object or a non-scalar: Lightning's own handling)
        here = float(value.detach().double().cpu()) if isinstance(value, torch.Tensor) else float(value)
        values: list = [None] * dist.get_world_size()
        dist.all_gather_object(values, here)
        if all(v == values[0] or v != v and values[0] != values[0] for v in values):  # equal (NaN on every rank too)
            return
        self.named.add(name)
        shown = ", ".join(f"{v:.6g}" for v in values)
        why = (
            f"{name}, logged from {hook}, differs between the ranks ({shown}): each computed it from its own shard, "
            "and their mean is not the value of the whole split that 1 process logs"
        )
        fix = "gather the epoch's rows with self.all_gather (every rank gets all rows, in dataset order) or use a torchmetrics metric"
        if name in set(self.monitored()):
            raise ConfigError(f"{why}, and it is the metric the run selects by: {fix}.")
        if dist.get_rank() == 0:
            log.warning(f"{why}: {fix}.")
