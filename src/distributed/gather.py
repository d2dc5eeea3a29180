"""Gather per-rank evaluation outputs into one tensor in dataset order, each sample exactly once.

The all_gather pattern for custom metrics: collect predictions and targets in `validation_step`,
then in `on_validation_epoch_end` call `gather_shards(torch.cat(preds))` on every rank. It relies
on `ShardSampler`'s round-robin deal (rank r holds samples r, r+W, ...), so no padding and no
duplicates reach the result, unlike `LightningModule.all_gather` over a padding DistributedSampler.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from src.distributed.samplers import rank_and_world


def gather_shards(local: torch.Tensor) -> torch.Tensor:
    """All ranks' rows of `local` (dim 0), interleaved back into dataset order. A collective: call on every rank."""
    _, world = rank_and_world()
    if world == 1:
        return local
    sizes = [torch.zeros(1, dtype=torch.long, device=local.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([local.shape[0]], device=local.device))
    sizes = [int(s) for s in sizes]
    padded = local.new_zeros((max(sizes), *local.shape[1:]))  # all_gather needs equal shapes
    padded[: local.shape[0]] = local
    shards = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(shards, padded)
    out = local.new_empty((sum(sizes), *local.shape[1:]))
    for rank, (shard, size) in enumerate(zip(shards, sizes)):
        out[rank::world] = shard[:size]
    return out
