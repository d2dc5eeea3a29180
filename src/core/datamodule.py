"""What every datamodule here shares: a global batch that does not depend on the device count, and
samplers that give each rank its own samples in training and each sample exactly once in evaluation
(every rank the same number of evaluation batches, short shards filled with label-less padding)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from src.core.seeded import SeededItems
from src.parallel.samplers import EvenBatches, ShardSampler, rank_and_world, train_sampler
from src.utils.config import ConfigError, check_int
from src.utils.labels import IGNORE_INDEX

log = logging.getLogger(__name__)


class ResumableLoader(DataLoader):
    """Tells Lightning that this loader resumes mid-epoch (its sampler skips what was already trained,
    see ShardedDataModule.train_dataloader); it keeps no state of its own."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


def ignore_labels(sample: Any) -> Any:
    """`sample` with every label set to IGNORE_INDEX: a dict's "labels", or a tuple's last item (x, y)."""

    def ignored(labels: Any) -> Any:
        if isinstance(labels, torch.Tensor):
            return torch.full_like(labels, IGNORE_INDEX)
        if isinstance(labels, int):
            return IGNORE_INDEX
        if isinstance(labels, (np.ndarray, np.generic)):
            return np.full_like(labels, IGNORE_INDEX)
        raise TypeError(
            f"Cannot make a padding sample from labels of type {type(labels).__name__}; "
            "override ShardedDataModule.padding_sample for this data."
        )

    if isinstance(sample, dict) and "labels" in sample:
        return {**sample, "labels": ignored(sample["labels"])}
    # only a pair says which item is the labels: a longer tuple's last item may be anything (packed rows' position
    # ids were once blanked as if they were labels)
    if isinstance(sample, (tuple, list)) and len(sample) == 2:
        return type(sample)([sample[0], ignored(sample[1])])
    raise TypeError(
        f"Cannot make a padding sample from a {type(sample).__name__} (expected a dict with 'labels' or an "
        "(inputs, labels) pair); override ShardedDataModule.padding_sample for this data."
    )


class PaddedSplit(Dataset):
    """An evaluation split plus one padding item at index len(split) (where ShardSampler points
    short shards): a real sample's inputs with every label ignored, so it runs the same forward
    as the others and adds nothing to any loss or metric."""

    def __init__(self, split: Dataset, padding: Any) -> None:
        self.split, self.padding = split, padding

    def __len__(self) -> int:
        return len(self.split) + 1

    def __getitem__(self, i: int) -> Any:
        return self.padding if i == len(self.split) else self.split[i]


class Indexed(Dataset):
    """A training split whose item i is (i, the split's item i): the collate below adds each batch's sample indices,
    which key the module's dropout masks (src/core/dropout.py) and are the same on every layout."""

    def __init__(self, split: Dataset) -> None:
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> tuple[int, Any]:
        return i, self.split[i]


class IndexedCollate:
    """`collate` (None: torch's default) of Indexed items; a dict batch gets `sample_index`, the items' indices."""

    def __init__(self, collate: Optional[Callable]) -> None:
        self.collate = collate or default_collate

    def __call__(self, items: list[tuple[int, Any]]) -> Any:
        batch = self.collate([item for _, item in items])
        if isinstance(batch, dict):
            batch["sample_index"] = torch.tensor([i for i, _ in items], dtype=torch.long)
        return batch


def batches_done_this_epoch(trainer: Any, batches_per_epoch: int) -> int:
    """Batches of the current epoch already trained when fit resumes from a mid-epoch checkpoint."""
    if trainer is None or not trainer.fit_loop.restarting:
        return 0
    limit = trainer.limit_train_batches  # as Lightning counts an epoch: an int caps it, a float scales it
    epoch = min(batches_per_epoch, limit) if isinstance(limit, int) else int(batches_per_epoch * limit)
    # the checkpoint is written in on_train_batch_end: Lightning counts that batch as done on restart
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    return done if done < epoch else 0  # a checkpoint at the epoch's end resumes with a fresh epoch


def micro_batch_size(
    global_batch_size: int,
    replicas: int,
    split: int,
    ranks: Optional[str] = None,
    split_key: str = "trainer.accumulate_grad_batches",
) -> int:
    """Per-replica batch so that the optimizer always sees `global_batch_size` samples per step, or one sentence: the
    one check of it, run before any rank starts (src/run/checks.py, `ranks` saying how the config lays them out) and
    again in setup, where the world size is known for sure (torchrun, devices=-1). `replicas`: the data-parallel
    ranks, each reading its own samples (all ranks, but a tensor-parallel or pipeline group reads the same ones);
    `split`: the micro-batches each replica's share is cut into, `split_key` (accumulation steps, or the pipeline's
    trainer.strategy.n_microbatches)."""
    per_step = replicas * split
    if global_batch_size % per_step:
        shapes = working_shapes(global_batch_size, replicas, split, split_key)
        raise ConfigError(
            f"data.global_batch_size={global_batch_size} does not divide into {ranks or f'{replicas} device(s)'} x "
            f"{split_key}={split} = {per_step}: {shapes}."
        )
    return global_batch_size // per_step


def working_shapes(
    global_batch_size: int, replicas: int, split: int, split_key: str = "trainer.accumulate_grad_batches"
) -> str:
    """The nearest replica counts (at this split) and splits (on these replicas) that divide the global batch, so a
    resumed run keeps it: "use 2 or 4 device(s), or trainer.accumulate_grad_batches=3 on 5 device(s)"."""
    devices = [d for d in range(1, global_batch_size + 1) if global_batch_size % (d * split) == 0]
    nearest = sorted(sorted(devices, key=lambda d: (abs(d - replicas), d))[:2])
    options = [f"use {' or '.join(map(str, nearest))} device(s)"] if nearest else []
    splits = [a for a in range(1, global_batch_size + 1) if global_batch_size % (replicas * a) == 0]
    if splits:
        best = min(splits, key=lambda a: (abs(a - split), a))
        options.append(f"{split_key}={best} on {replicas} device(s)")
    options.append(f"a data.global_batch_size that is a multiple of {replicas * split}")
    return ", or ".join(options)


class ShardedDataModule(L.LightningDataModule):
    """Subclasses fill `self.splits` ("train", "val", "test" -> Dataset) in `build_splits`.

    The data.* keys every datamodule takes are typed and checked here, once: a subclass takes its own keys and
    passes the rest on (`**shared`; src/utils/config.py's key check reads this signature through it)."""

    # what a batch holds, for a module that reads several kinds: images (data=digits, mnist) | samples (anything else:
    # your own data); a subclass names its own kinds
    batch_kind = "samples"
    # Evaluation on N ranks: False (the default), each rank's shard in as many batches as every other's, near-equal in
    # size, no padding: whatever the module logs (self.log's means, torchmetrics, a count) counts each sample once.
    # True: every batch but the last of one size, short shards ending with a padding sample whose labels are ignored
    # (padding_sample), for a module whose metrics leave the ignored labels out.
    pad_evaluation = False
    # Randomness keyed by sample: False (the default), a Dataset's own random draws (augmentation) keyed by (seed,
    # epoch, sample) (seeded.py); True, for dict batches whose module keys its randomness itself: each train batch
    # carries its samples' indices (`sample_index`) instead.
    indexes_samples = False

    def __init__(
        self,
        global_batch_size: int = 32,
        eval_batch_size: Optional[int] = None,
        num_workers: int = 0,
        seed: Optional[int] = 42,
        overfit_batches: int = 0,
    ) -> None:
        super().__init__()
        check_int("data.global_batch_size", global_batch_size)
        if eval_batch_size is not None:
            check_int("data.eval_batch_size", eval_batch_size)
        if overfit_batches < 0:
            raise ConfigError(f"data.overfit_batches={overfit_batches}: use 0 (off) or a number of global batches.")
        self.global_batch_size, self.eval_batch_size = global_batch_size, eval_batch_size
        self.num_workers, self.seed, self.overfit_batches = num_workers, seed, overfit_batches
        self.batch_size: Optional[int] = None  # per-device micro-batch, set in setup()
        self.splits: dict[str, Dataset] = {}
        self._target_counts: Optional[tuple[Dataset, Any]] = None  # (train split, its targets per sample)

    def build_splits(self) -> dict[str, Dataset]:
        raise NotImplementedError

    def setup(self, stage: Optional[str] = None) -> None:
        trainer = self.trainer
        accumulate = trainer.accumulate_grad_batches if trainer else 1
        world = self.data_ranks()[1]
        if stage in (None, "fit"):
            self.batch_size = micro_batch_size(self.global_batch_size, world, accumulate)
        else:  # evaluating only (eval.py): there is no optimizer step, so the global batch need not divide
            self.batch_size = max(1, self.global_batch_size // (world * accumulate))
        if not self.splits:
            self.splits = self.build_splits()
            if self.overfit_batches:
                self.splits = self.overfit_splits(self.splits["train"])

    def overfit_splits(self, train: Dataset) -> dict[str, Dataset]:
        """`data.overfit_batches=N`: train, validate and test on the first N global batches' samples.

        Unlike Lightning's `trainer.overfit_batches` (which swaps in a SequentialSampler, so every
        rank reads the same batches), this keeps our samplers: ranks share the samples between them
        and a global batch is the same samples on 1 or N devices.
        """
        n = self.overfit_batches * self.global_batch_size
        if n > len(train):
            raise ValueError(
                f"data.overfit_batches={self.overfit_batches} x data.global_batch_size="
                f"{self.global_batch_size} = {n} samples, but the training split has {len(train)}."
            )
        subset = Subset(train, range(n))
        log.info(f"data.overfit_batches={self.overfit_batches}: train, val and test are the first {n} training samples")
        return {"train": subset, "val": subset, "test": subset}

    def collate_fn(self) -> Optional[Callable]:
        """The loaders' collate function; None = torch's default. Passed to the DataLoader constructor,
        as Lightning rebuilds loaders from their constructor arguments (e.g. for fault tolerance)."""
        return None

    def padding_sample(self, sample: Any) -> Any:
        """The evaluation padding made from a real `sample`: the same inputs, every label ignored."""
        return ignore_labels(sample)

    def data_ranks(self) -> tuple[int, int]:
        """(this rank, the number of ranks) among those the data is dealt over: the data-parallel ranks of the
        trainer's strategy (src/parallel/samplers.py rank_and_world); all ranks without a trainer."""
        return rank_and_world(self.trainer)

    def samples_per_batch(self) -> int:
        """The samples one per-rank batch index stands for: micro-batch x data-parallel ranks."""
        return self.batch_size * self.data_ranks()[1]

    def step_targets(self, epoch: int, accumulate: int) -> Optional[tuple[Any, int]]:
        """(the targets of each optimizer step of `epoch`, over all ranks and accumulation micro-batches;
        the data-parallel ranks that table counts), or None when the train split cannot count its targets.

        The training sampler draws one seeded permutation per epoch that all ranks share, so every rank computes
        the same table from the per-sample counts (computed once, numpy): no communication, no host sync."""
        dataset = self.splits.get("train")
        if not hasattr(dataset, "target_counts"):
            return None
        if self._target_counts is None or self._target_counts[0] is not dataset:
            self._target_counts = (dataset, dataset.target_counts())
        sampler = train_sampler(dataset, self.seed or 0, self.data_ranks())  # the order the train loader reads
        return sampler.step_totals(self._target_counts[1], self.batch_size, accumulate, epoch), sampler.num_replicas

    def train_dataloader(self) -> DataLoader:
        # `indexes_samples`: dict batches carry their samples' indices; any other batch is the user's as collated
        # (src/callbacks/user_module.py reads the sampler instead), its Dataset's draws keyed by sample (seeded.py)
        indexed = self.indexes_samples
        split = self.splits["train"]
        dataset = Indexed(split) if indexed else SeededItems(split, self.seed or 0)
        collate = IndexedCollate(self.collate_fn()) if indexed else self.collate_fn()
        sampler, batch = train_sampler(dataset, self.seed or 0, self.data_ranks()), self.batch_size
        sampler.with_epoch = not indexed
        sampler.skip = batches_done_this_epoch(self.trainer, len(sampler) // batch) * batch
        return ResumableLoader(
            dataset,
            batch_size=batch,
            sampler=sampler,
            drop_last=True,
            collate_fn=collate,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    def eval_loader(self, split: str) -> DataLoader:
        """Evaluation's loader of any split: each sample once over all ranks, every rank the same number of batches:
        near-equal batches and no padding (EvenBatches), or, with `pad_evaluation`, batches of one size whose short
        shards end with the padding item (ShardSampler)."""
        dataset, size = self.splits[split], self.eval_batch_size or self.batch_size
        if not self.pad_evaluation:
            batches = {"batch_sampler": EvenBatches(len(dataset), size, self.data_ranks())}
        else:
            sampler = ShardSampler(len(dataset), self.data_ranks())
            if len(dataset) % sampler.world:  # some shards are one short: they get the padding item
                dataset = PaddedSplit(dataset, self.padding_sample(dataset[0]))
            batches = {"batch_size": size, "sampler": sampler, "drop_last": False}
        if not self.indexes_samples:  # a Dataset's own random draws keyed by sample (seeded.py)
            dataset = SeededItems(dataset, self.seed or 0)
        return DataLoader(
            dataset,
            **batches,
            collate_fn=self.collate_fn(),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    def val_dataloader(self) -> DataLoader:
        return self.eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self.eval_loader("test")
