"""What every datamodule here shares: a global batch that does not depend on the device count, and
samplers that give each rank its own samples in training and each sample exactly once in evaluation."""

from __future__ import annotations

from typing import Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from src.distributed.samplers import ShardSampler, rank_and_world, train_sampler


class ResumableLoader(DataLoader):
    """Tells Lightning that this loader resumes mid-epoch (its sampler skips what was already trained,
    see ShardedDataModule.train_dataloader); it keeps no state of its own."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


def micro_batch_size(global_batch_size: int, world_size: int, accumulate_grad_batches: int) -> int:
    """Per-device batch so that the optimizer always sees `global_batch_size` samples per step."""
    per_step = world_size * accumulate_grad_batches
    if global_batch_size % per_step:
        raise ValueError(
            f"data.global_batch_size={global_batch_size} does not divide into {world_size} device(s) x "
            f"{accumulate_grad_batches} accumulation step(s) = {per_step}. Pick a global batch that is a "
            f"multiple of {per_step}, or change trainer.devices / trainer.accumulate_grad_batches."
        )
    return global_batch_size // per_step


class ShardedDataModule(L.LightningDataModule):
    """Subclasses fill `self.splits` ("train", "val", "test" -> Dataset) in `build_splits`."""

    def __init__(self, global_batch_size: int, eval_batch_size: Optional[int], num_workers: int,
                 seed: Optional[int]) -> None:
        super().__init__()
        self.global_batch_size, self.eval_batch_size = global_batch_size, eval_batch_size
        self.num_workers, self.seed = num_workers, seed
        self.batch_size: Optional[int] = None  # per-device micro-batch, set in setup()
        self.splits: dict[str, Dataset] = {}

    def build_splits(self) -> dict[str, Dataset]:
        raise NotImplementedError

    def setup(self, stage: Optional[str] = None) -> None:
        trainer = self.trainer
        accumulate = trainer.accumulate_grad_batches if trainer else 1
        world = rank_and_world()[1]
        if stage in (None, "fit"):
            self.batch_size = micro_batch_size(self.global_batch_size, world, accumulate)
        else:  # evaluating only (eval.py): there is no optimizer step, so the global batch need not divide
            self.batch_size = max(1, self.global_batch_size // (world * accumulate))
        if not self.splits:
            self.splits = self.build_splits()

    def batches_done_this_epoch(self, batches_per_epoch: int) -> int:
        """Batches of the current epoch already trained when fit resumes from a mid-epoch checkpoint."""
        trainer = self.trainer
        if trainer is None or not trainer.fit_loop.restarting:
            return 0
        limit = trainer.limit_train_batches  # as Lightning counts an epoch: an int caps it, a float scales it
        epoch = min(batches_per_epoch, limit) if isinstance(limit, int) else int(batches_per_epoch * limit)
        # the checkpoint is written in on_train_batch_end: Lightning counts that batch as done on restart
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return done if done < epoch else 0  # a checkpoint at the epoch's end resumes with a fresh epoch

    def _loader(self, split: str) -> DataLoader:
        dataset = self.splits[split]
        if split == "train":
            sampler, batch, drop_last = train_sampler(dataset, self.seed or 0), self.batch_size, True
            sampler.skip = self.batches_done_this_epoch(len(sampler) // batch) * batch
            loader_class = ResumableLoader
        else:
            sampler, batch, drop_last = ShardSampler(len(dataset)), self.eval_batch_size or self.batch_size, False
            loader_class = DataLoader
        return loader_class(dataset, batch_size=batch, sampler=sampler, drop_last=drop_last,
                            num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
                            pin_memory=torch.cuda.is_available())

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")
