"""A LightningModule and a LightningDataModule written as Lightning's docs teach them, with nothing of this template:
DataLoaders of their own (`batch_size=32, shuffle=True`), `self.log` with and without `sync_dist`, torchmetrics
logged through `self.log`, BatchNorm and dropout. The user a template is cloned for; the tests train them on 1 and N
ranks through train.py (conf/ files written by `write_configs`) and compare."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class PlainTable(L.LightningDataModule):
    """scikit-learn's breast_cancer table (569 rows, 30 features, 2 classes): 455 train, 57 val, 57 test rows."""

    def __init__(self, batch_size: int = 32, num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size, self.num_workers = batch_size, num_workers

    def setup(self, stage: str | None = None) -> None:
        from sklearn.datasets import load_breast_cancer

        x, y = load_breast_cancer(return_X_y=True)
        x = torch.tensor((x - x.mean(0)) / x.std(0), dtype=torch.float32)
        y = torch.tensor(y)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        x, y = x[order], y[order]
        self.train_set = TensorDataset(x[:455], y[:455])
        self.val_set = TensorDataset(x[455:512], y[455:512])
        self.test_set = TensorDataset(x[512:], y[512:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.batch_size, num_workers=self.num_workers)


class PlainMLP(L.LightningModule):
    def __init__(
        self,
        hidden: int = 64,
        dropout: float = 0.0,
        lr: float = 1e-2,
        noise: float = 0.0,
        rank_own: bool = False,
        adamw: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(30, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 2)
        )
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=2)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=2)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.hparams.noise:  # randomness of the module's own, drawn from the rank's generator
            x = x + self.hparams.noise * torch.randn_like(x)
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train/loss", loss)
        self.train_acc(logits, y)
        self.log("train/acc", self.train_acc)  # the batch's accuracy, each step
        if self.hparams.rank_own:  # Lightning's default said out loud: this rank's own value
            self.log("train/loss_here", loss, sync_dist=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val/loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.val_acc(logits, y)
        self.log("val/acc", self.val_acc)
        self.log("val/n", float(len(y)), reduce_fx="sum")

    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("test/loss", nn.functional.cross_entropy(logits, y))
        self.test_acc(logits, y)
        self.log("test/acc", self.test_acc)

    def configure_optimizers(self):
        if self.hparams.adamw:  # the bias before the BatchNorm: Adam turns its rounding-level gradient into steps
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def write_configs(conf: Path) -> Path:
    """conf/model/plain_mlp.yaml, conf/data/plain_table.yaml and conf/experiment/plain.yaml under `conf` (a dir
    given to train.py as `hydra.searchpath=[file://<conf>]`), as a user adds them; returns `conf`."""
    for group, text in {
        "model/plain_mlp.yaml": "_target_: tests.helpers.plain_lightning.PlainMLP\nhidden: 64\ndropout: 0.0\nlr: 1.0e-2\nnoise: 0.0\nrank_own: false\nadamw: false\n",
        "data/plain_table.yaml": "_target_: tests.helpers.plain_lightning.PlainTable\nbatch_size: 32\nnum_workers: 0\n",
        "experiment/plain.yaml": (
            "# @package _global_\ndefaults:\n  - override /data: plain_table\n  - override /model: plain_mlp\n"
            "optimized_metric: val/acc\ncallbacks:\n  generate_text: null\n  model_checkpoint:\n"
            "    monitor: val/acc\n    mode: max\ntrainer:\n  precision: 32-true\n"
        ),
    }.items():
        (conf / group).parent.mkdir(parents=True, exist_ok=True)
        (conf / group).write_text(text)
    return conf
