"""Callbacks every run gets (src/run/always_on.py): they fix things that should never be left to the user."""

from __future__ import annotations

import logging
import os
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from src.utils.machine import available_cores

log = logging.getLogger(__name__)


class CpuThreadsPerRank(L.Callback):
    """Give each CPU rank its share of the cores: 2 ranks x 2 threads on 2 cores ran 4-15x slower here.

    Lightning's launcher already does this unless OMP_NUM_THREADS is set; this also caps an
    inherited OMP_NUM_THREADS (e.g. from a shell profile) that would oversubscribe the machine.
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.strategy.root_device.type != "cpu":
            return
        local_ranks = max(1, trainer.num_devices)
        share = max(1, available_cores() // local_ranks)
        if torch.get_num_threads() > share:
            torch.set_num_threads(share)
        log.info(
            f"[rank {trainer.global_rank}] pid {os.getpid()}, torch threads: {torch.get_num_threads()} "
            f"({available_cores()} cores / {local_ranks} local rank(s))"
        )


class StepsInProgressBar(L.Callback):
    """A run bounded by `trainer.max_steps` (max_epochs=-1) read "Epoch 0/-2" in Lightning's rich progress bar: its
    training bar reads "Step s/max_steps" instead. Through RichProgressBar's public `progress` and
    `train_progress_bar_id`; other bars, or a run bounded by epochs, are left as they are."""

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.describe(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.describe(trainer)

    @staticmethod
    def describe(trainer: L.Trainer) -> None:
        from lightning.pytorch.callbacks import RichProgressBar

        bar = trainer.progress_bar_callback
        if trainer.max_steps <= 0 or (trainer.max_epochs or -1) > 0 or not isinstance(bar, RichProgressBar):
            return
        if bar.progress is not None and bar.train_progress_bar_id is not None:
            bar.progress.update(
                bar.train_progress_bar_id, description=f"Step {trainer.global_step}/{trainer.max_steps}"
            )


class ConfigInCheckpoint(L.Callback):
    """Store the model and data config (and the precision trained at) in every checkpoint, so eval.py rebuilds exactly
    what was trained and evaluates it as training's validation did.

    More than `save_hyperparameters()`: the resolved `_target_` configs of both the model and the datamodule (which
    class, its tokenizer, splits and paths made absolute), so eval.py, export-hf and SFT -> DPO rebuild both from
    the one file with `instantiate`, whichever LightningModule class it was."""

    def __init__(self, cfg: DictConfig) -> None:
        self.config = {key: OmegaConf.to_container(cfg[key], resolve=True) for key in ("model", "data")}
        self.config["trainer"] = {"precision": OmegaConf.select(cfg, "trainer.precision")}  # resolved: what ran

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint["config"] = self.config
