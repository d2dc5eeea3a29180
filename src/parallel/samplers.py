"""Who sees which sample. We shard data ourselves (`trainer.use_distributed_sampler: false`) because
Lightning's default for val/test is a `DistributedSampler` that pads every rank to the same length by
repeating samples: 10 samples on 3 ranks become 12 evaluated, and the metrics count the repeats.

The samplers take `ranks`, (this rank, the number of ranks) among those the data is dealt over: what
`rank_and_world(trainer)` reads from the trainer's strategy.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, Sampler

from src.parallel.capabilities import of
from src.utils.config import ConfigError


def data_mesh(trainer: Optional[Any]) -> Optional[Any]:
    """The mesh `trainer`'s strategy deals the data over (capabilities.py `data_mesh`: a pipeline or tensor-parallel
    group reads the same samples), or None: all ranks, as without a trainer."""
    return of(trainer.strategy).data_mesh if trainer is not None else None


def data_parallel_group(trainer: Optional[Any]) -> Any:
    """The process group over which the samples are dealt (None: the default group, all ranks)."""
    mesh = data_mesh(trainer)
    return mesh.get_group() if mesh is not None else None


def rank_and_world(trainer: Optional[Any]) -> tuple[int, int]:
    """(this rank, the number of ranks) among those the data is dealt over (`data_mesh`'s, else all ranks)."""
    mesh = data_mesh(trainer)
    if mesh is not None:
        return mesh.get_local_rank(), mesh.size()
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ResumableDistributedSampler(DistributedSampler):
    """A DistributedSampler whose next pass can start part-way, so a run resumed from a mid-epoch
    checkpoint trains on exactly the rest of that epoch. Its length stays the full epoch's (Lightning
    counts the restored batches on top)."""

    skip = 0  # indices of this rank's next pass to leave out; reset after one pass
    with_epoch = False  # deal (epoch, index) pairs: what keys a Dataset's random augmentation (src/core/seeded.py)

    def epoch_order(self, epoch: Optional[int] = None) -> np.ndarray:
        """The epoch's permutation as every rank computes it, the dropped tail removed (what
        DistributedSampler draws with shuffle=True, drop_last=True); rank r reads positions r, r+W, ...
        Without shuffle, the dataset's own order."""
        n = len(self.dataset)
        # int32 where it fits: 4 bytes a sample instead of 8, and the same draws, so the same order
        dtype = torch.int32 if n < 2**31 else torch.int64
        if not self.shuffle:
            return torch.arange(self.total_size, dtype=dtype).numpy()
        g = torch.Generator()
        g.manual_seed(self.seed + (self.epoch if epoch is None else epoch))
        return torch.randperm(n, generator=g, dtype=dtype).numpy()[: self.total_size]

    def __iter__(self) -> Iterator[int]:
        indices = self.epoch_order()[self.rank :: self.num_replicas]
        skip, self.skip = self.skip, 0
        # Read lazily from the array: a list of the epoch's indices would be ~44 bytes a sample in RAM
        # (a 2 GB corpus at seq_len 128: 15 M blocks, 0.7 GB per rank)
        if self.with_epoch:
            return zip(itertools.repeat(self.epoch), map(int, indices[skip:]))
        return map(int, indices[skip:])

    def batch(self, batch_idx: int, batch_size: int) -> np.ndarray:
        """The dataset indices of this rank's batch `batch_idx` of the current epoch, as `__iter__` deals them (from a
        mid-epoch checkpoint Lightning's batch_idx counts on, as `skip` leaves out the batches done). The rank's
        order is kept for the epoch: one permutation an epoch, not one a batch."""
        cached = self.__dict__.get("_rank_order")
        if cached is None or cached[0] != self.epoch:
            cached = self._rank_order = (self.epoch, self.epoch_order()[self.rank :: self.num_replicas])
        return cached[1][batch_idx * batch_size : (batch_idx + 1) * batch_size]

    def step_totals(self, counts: np.ndarray, micro_batch: int, accumulate: int, epoch: int) -> np.ndarray:
        """Per optimizer step of `epoch`: the sum of `counts` (e.g. target tokens per sample) over the
        step's samples on all ranks and all accumulation micro-batches.

        Every rank computes the same table from the shared permutation, so no communication is needed:
        the k-th micro-batch of every rank together is positions [k*b*W, (k+1)*b*W) of the order, and
        step s is micro-batches [s*A, (s+1)*A) (the epoch's last step may have fewer, as Lightning runs it).
        """
        world = self.num_replicas
        n_micro = self.num_samples // micro_batch  # DataLoader(drop_last=True) drops each rank's partial batch
        counts = np.asarray(counts, dtype=np.int64)
        if counts.size and counts.min() == counts.max():  # e.g. full packed blocks: no order needed
            per_micro = np.full(n_micro, int(counts[0]) * micro_batch * world, dtype=np.int64)
        else:
            order = self.epoch_order(epoch)[: n_micro * micro_batch * world]
            per_micro = counts[order].reshape(n_micro, micro_batch * world).sum(1)
        return np.add.reduceat(per_micro, np.arange(0, n_micro, accumulate)) if n_micro else per_micro


def train_sampler(dataset, seed: int, ranks: tuple[int, int], shuffle: bool = True) -> ResumableDistributedSampler:
    """One seeded permutation per epoch (shuffle=False: the dataset's order), shared by all ranks; rank r of
    `ranks` = (r, W) takes positions r, r+W, r+2W, ...

    So a global batch is the same samples whatever the device count (1 x 8 or 2 x 4 read the same 8),
    each epoch has a new order (Lightning calls `set_epoch`), and a restart with the same seed
    replays it. The tail that does not fill a whole round over all ranks is dropped.
    """
    rank, world = ranks
    return ResumableDistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=True
    )


class ShardSampler(Sampler[int]):
    """Every index exactly once over all ranks, dealt round-robin (rank r: r, r+W, r+2W, ...), each
    shard padded to ceil(n / W) with the index `dataset_len`: one past the end, which the loader maps
    to a padding sample whose labels are all ignored (see `PaddedSplit`).

    Why pad: FSDP2 and ZeRO-3 all-gather the parameters in every forward, evaluation included, so
    a rank with one batch less would leave the others blocked in that collective forever. Equal
    shards give every rank the same number of batches of the same size; the padding carries no
    target, so the metrics (sums and counts, synced by torchmetrics) still count each real sample
    once. Lightning's `DistributedSampler` pads too, but with repeated real samples, which count twice.
    """

    def __init__(self, dataset_len: int, ranks: tuple[int, int]) -> None:
        self.rank, self.world = ranks
        if dataset_len < self.world:
            raise ConfigError(
                f"An evaluation split of {dataset_len} sample(s) cannot give each of "
                f"{self.world} ranks at least one; use a larger val/test split or fewer devices."
            )
        self.dataset_len = dataset_len
        self.per_rank = -(-dataset_len // self.world)  # ceil: the longest shard
        self.real = range(self.rank, dataset_len, self.world)
        self.n_padding = self.per_rank - len(self.real)  # 0 or 1 on this rank

    def __iter__(self) -> Iterator[int]:
        yield from self.real
        yield from [self.dataset_len] * self.n_padding

    def __len__(self) -> int:
        return self.per_rank

    def is_padding(self, index: int) -> bool:
        return index >= self.dataset_len


class EvenBatches(Sampler[list[int]]):
    """Evaluation without padding: every index once over all ranks, dealt round-robin (rank r: r, r+W, r+2W, ...), and
    each rank's shard cut into the same number of batches of near-equal size: as many as the longest shard needs in
    batches of `batch_size`, or, where the shortest shard holds fewer samples than that, one batch per sample of it
    (so a batch may hold a sample or so more than `batch_size`: 11 samples on 3 ranks in batches of 1 are 3 batches
    on each, 2+1+1 on the first two ranks).

    Every rank runs the same number of forwards (what FSDP2's and ZeRO-3's gathers need, see ShardSampler), and no
    batch holds a sample that is not real: a mean weighted by each batch's size (Lightning's `self.log` reduction,
    synced over ranks) and a torchmetrics metric count each sample once, whatever the module logs."""

    def __init__(self, dataset_len: int, batch_size: int, ranks: tuple[int, int]) -> None:
        rank, world = ranks
        longest, shortest = -(-dataset_len // world), dataset_len // world
        if shortest == 0:
            raise ConfigError(
                f"An evaluation split of {dataset_len} sample(s) cannot give each of {world} ranks at least one: use a "
                "larger val/test split or fewer devices."
            )
        self.n_batches = min(-(-longest // batch_size), shortest)
        self.shard = np.arange(rank, dataset_len, world)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in np.array_split(self.shard, self.n_batches):
            yield batch.tolist()

    def __len__(self) -> int:
        return self.n_batches
