"""A LightningModule and a LightningDataModule written as Lightning's docs teach them, with nothing of this template:
DataLoaders of their own (`batch_size=32, shuffle=True`), `self.log` with and without `sync_dist`, torchmetrics
logged through `self.log`, BatchNorm and dropout. The user a template is cloned for; the tests train them on 1 and N
ranks through train.py (conf/ files written by `write_configs`) and compare."""

from __future__ import annotations

import random
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset


class PlainTable(L.LightningDataModule):
    """scikit-learn's breast_cancer table (569 rows, 30 features, 2 classes): 455 train, 57 val, 57 test rows."""

    def __init__(self, batch_size: int = 32, num_workers: int = 0, augment: float = 0.0, own_rng: bool = False) -> None:
        super().__init__()
        self.batch_size, self.num_workers, self.augment, self.own_rng = batch_size, num_workers, augment, own_rng

    def setup(self, stage: str | None = None) -> None:
        from sklearn.datasets import load_breast_cancer

        x, y = load_breast_cancer(return_X_y=True)
        x = torch.tensor((x - x.mean(0)) / x.std(0), dtype=torch.float32)
        y = torch.tensor(y)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        x, y = x[order], y[order]
        self.train_set = Jitter(TensorDataset(x[:455], y[:455]), self.augment, self.own_rng)
        self.val_set = TensorDataset(x[455:512], y[455:512])
        self.test_set = TensorDataset(x[512:], y[512:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.batch_size, num_workers=self.num_workers)


class Jitter(Dataset):
    """Random augmentation as vision pipelines draw it, in `__getitem__`: noise from torch's, numpy's and Python's
    global generators (in the main process or a loader worker)."""

    def __init__(self, data: Dataset, scale: float, own_rng: bool = False) -> None:
        self.data, self.scale = data, scale
        self.rng = (
            np.random.default_rng(0) if own_rng else None
        )  # a generator of its own: each rank's copy advances alone

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        x, y = self.data[i]
        if self.scale and self.rng is not None:
            return x + self.scale * torch.from_numpy(self.rng.normal(size=x.shape).astype(np.float32)), y
        if self.scale:
            numpy_noise = torch.from_numpy(np.random.normal(size=x.shape).astype(np.float32))
            x = x + self.scale * (torch.randn_like(x) + numpy_noise) * random.uniform(0.5, 1.5)
        return x, y


class PlainMLP(L.LightningModule):
    def __init__(
        self,
        hidden: int = 64,
        dropout: float = 0.0,
        lr: float = 1e-2,
        noise: float = 0.0,
        rank_own: bool = False,
        epoch_metric: str = "none",
        optimizer: str = "sgd",
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.outputs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (predictions, targets) of the epoch's batches
        self.net = nn.Sequential(
            nn.Linear(30, hidden, bias=bias),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, 2),
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
        self.outputs.append((logits.argmax(1), y))

    def on_validation_epoch_end(self):
        """Lightning's documented habit: the epoch's predictions collected in a list, an accuracy from them here;
        epoch_metric=own: this rank's rows; gathered: every rank's, with self.all_gather."""
        if self.hparams.epoch_metric != "none":
            preds, targets = (torch.cat(t) for t in zip(*self.outputs))
            if self.hparams.epoch_metric == "gathered":
                preds, targets = self.all_gather(preds), self.all_gather(targets)
            self.log("val/acc_epoch", (preds == targets).float().mean())
        self.outputs.clear()

    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("test/loss", nn.functional.cross_entropy(logits, y))
        self.test_acc(logits, y)
        self.log("test/acc", self.test_acc)

    def configure_optimizers(self):
        if self.hparams.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class PlainTokens(L.LightningDataModule):
    """A text-classification task on token ids, as a user's own: 256 train, 61 val (uneven on 2 ranks), 61 test rows
    of 12 tokens; the label is which third of the vocabulary most of a row's tokens come from."""

    def __init__(self, batch_size: int = 16, vocab: int = 60, num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size, self.vocab, self.num_workers = batch_size, vocab, num_workers

    def setup(self, stage: str | None = None) -> None:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, self.vocab, (378, 12), generator=g)
        labels = torch.bucketize(ids.float().mean(1), torch.tensor([self.vocab / 3 + 6, 2 * self.vocab / 3 - 4]))
        self.sets = {"train": (0, 256), "val": (256, 317), "test": (317, 378)}
        self.sets = {k: TensorDataset(ids[a:b], labels[a:b]) for k, (a, b) in self.sets.items()}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.sets["train"], batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.sets["val"], batch_size=self.batch_size, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.sets["test"], batch_size=self.batch_size, num_workers=self.num_workers)


class PlainEncoder(L.LightningModule):
    """A transformers encoder fine-tuned as a classifier in a plain LightningModule: a small random config of
    `model_type` (bert, roberta, distilbert...) with its hidden and attention dropouts, SDPA attention."""

    def __init__(self, model_type: str = "bert", dropout: float = 0.1, lr: float = 1e-3, vocab: int = 60) -> None:
        super().__init__()
        self.save_hyperparameters()
        import transformers

        config = transformers.AutoConfig.for_model(
            model_type, **encoder_sizes(model_type), vocab_size=vocab, num_labels=3
        )
        for field in vars(config):
            if "dropout" in field and isinstance(getattr(config, field), float):
                setattr(config, field, dropout)
        self.encoder = transformers.AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids=ids).logits

    def training_step(self, batch, batch_idx):
        ids, y = batch
        loss = nn.functional.cross_entropy(self(ids), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        ids, y = batch
        logits = self(ids)
        self.log("val/loss", nn.functional.cross_entropy(logits, y))
        self.val_acc(logits, y)
        self.log("val/acc", self.val_acc)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def encoder_sizes(model_type: str) -> dict:
    """A tiny encoder of any family: two layers of width 32."""
    if model_type == "distilbert":
        return {"dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64, "max_position_embeddings": 64}
    sizes = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
    if model_type == "modernbert":  # its special tokens default to ids past a tiny vocabulary
        sizes.update(dict.fromkeys(("pad_token_id", "eos_token_id", "bos_token_id", "cls_token_id", "sep_token_id"), 0))
    return {**sizes, "max_position_embeddings": 64}


def write_configs(conf: Path) -> Path:
    """conf/model/plain_mlp.yaml, conf/data/plain_table.yaml and conf/experiment/plain.yaml under `conf` (a dir
    given to train.py as `hydra.searchpath=[file://<conf>]`), as a user adds them; returns `conf`."""
    for group, text in {
        "model/plain_mlp.yaml": "_target_: tests.helpers.plain_lightning.PlainMLP\nhidden: 64\ndropout: 0.0\nlr: 1.0e-2\nnoise: 0.0\nrank_own: false\nepoch_metric: none\noptimizer: sgd\nbias: true\n",
        "data/plain_table.yaml": "_target_: tests.helpers.plain_lightning.PlainTable\nbatch_size: 32\nnum_workers: 0\naugment: 0.0\nown_rng: false\n",
        "model/plain_encoder.yaml": "_target_: tests.helpers.plain_lightning.PlainEncoder\nmodel_type: bert\ndropout: 0.1\nlr: 1.0e-3\nvocab: 60\n",
        "data/plain_tokens.yaml": "_target_: tests.helpers.plain_lightning.PlainTokens\nbatch_size: 16\nvocab: 60\nnum_workers: 0\n",
        "experiment/plain_encoder.yaml": (
            "# @package _global_\ndefaults:\n  - override /data: plain_tokens\n  - override /model: plain_encoder\n"
            "optimized_metric: val/acc\ncallbacks:\n  generate_text: null\n  model_checkpoint:\n"
            "    monitor: val/acc\n    mode: max\ntrainer:\n  precision: 32-true\n"
        ),
        "experiment/plain.yaml": (
            "# @package _global_\ndefaults:\n  - override /data: plain_table\n  - override /model: plain_mlp\n"
            "optimized_metric: val/acc\ncallbacks:\n  generate_text: null\n  model_checkpoint:\n"
            "    monitor: val/acc\n    mode: max\ntrainer:\n  precision: 32-true\n"
        ),
    }.items():
        (conf / group).parent.mkdir(parents=True, exist_ok=True)
        (conf / group).write_text(text)
    return conf
