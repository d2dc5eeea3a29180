"""Gather per-rank evaluation outputs into one tensor in dataset order, each sample exactly once.

The all_gather pattern for custom metrics: collect predictions and targets in `validation_step`,
then in `on_validation_epoch_end` call `gather_shards(torch.cat(preds), n_samples, self.trainer)` on every
rank, with `n_samples = len(self.trainer.datamodule.splits["val"])`. It relies on `ShardSampler`'s
round-robin deal (rank r holds samples r, r+W, ..., then padding up to ceil(n / W)), so the padding
is dropped and no duplicates reach the result, unlike `LightningModule.all_gather` over a
DistributedSampler, which pads with repeated samples.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from src.parallel.samplers import data_parallel_group, rank_and_world


def gather_shards(local: torch.Tensor, n_samples: int, trainer: Optional[Any]) -> torch.Tensor:
    """The `n_samples` real rows of all ranks, in dataset order. A collective: call on every rank.

    `local` is this rank's rows (dim 0) in the order its ShardSampler gave them: either with the
    padding row (every rank ceil(n / W) rows) or with the padding already dropped. `trainer`: the one
    whose strategy dealt the data (None: dealt over all ranks).
    """
    rank, world = rank_and_world(trainer)
    per_rank, real = -(-n_samples // world), len(range(rank, n_samples, world))
    if local.shape[0] not in (per_rank, real):
        raise ValueError(
            f"gather_shards: rank {rank} holds {real} of the {n_samples} samples (+{per_rank - real} "
            f"padding) but was given {local.shape[0]} rows; pass n_samples = the split's length."
        )
    if world == 1:
        return local
    padded = local.new_zeros((per_rank, *local.shape[1:]))  # all_gather needs equal shapes
    padded[:real] = local[:real]
    shards = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(shards, padded, group=data_parallel_group(trainer))
    # row k of rank r is sample k * W + r: interleave, then cut the padding off the end
    return torch.stack(shards, dim=1).reshape(world * per_rank, *local.shape[1:])[:n_samples]


def gathered(rows: list[tuple[int, Any]]) -> list[Any]:
    """Every rank's (prompt number, result) rows, in prompt order (on every rank)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, rows)
        rows = [row for part in parts for row in part]
    return [result for _, result in sorted(rows, key=lambda row: row[0])]
