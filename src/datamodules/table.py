"""A table of numbers with a class per row: scikit-learn's bundled tables (offline) or a CSV file of your own.

The worked example of docs/your-model.md: a ShardedDataModule fills `self.splits` in `build_splits` and says what the
model needs to know of the data in `model_kwargs`; the base class makes the loaders that deal each rank its share.
"""

from __future__ import annotations

import csv
import logging
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from src.core.datamodule import ShardedDataModule
from src.utils.config import ConfigError

log = logging.getLogger(__name__)

BUNDLED = ("breast_cancer", "wine", "iris", "digits")  # scikit-learn's load_<name>()


class TableDataModule(ShardedDataModule):
    """`dataset`: one of BUNDLED, or "csv" with `path` (a header row, numeric columns, the class in `label_column`).
    The rows are shuffled once with a fixed seed and cut into val, test and train; the features are standardised
    with the training rows' mean and deviation."""

    def __init__(
        self,
        dataset: str = "breast_cancer",
        path: Optional[str] = None,
        label_column: str = "label",
        val_size: int = 57,
        test_size: int = 57,
        **shared: Any,
    ) -> None:
        super().__init__(**shared)
        if dataset not in (*BUNDLED, "csv"):
            raise ConfigError(f"data.dataset={dataset!r}: use one of {', '.join(BUNDLED)}, or csv with data.path.")
        if dataset == "csv" and not path:
            raise ConfigError("data.dataset=csv needs data.path: a CSV file with a header row.")
        self.dataset, self.path, self.label_column = dataset, path, label_column
        self.val_size, self.test_size = val_size, test_size
        self.features, self.labels = self.read()

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """(features, class of each row): float32 (rows, columns), int64 (rows)."""
        if self.dataset == "csv":
            with open(self.path, newline="") as f:
                header, *rows = list(csv.reader(f))
            if self.label_column not in header:
                raise ConfigError(
                    f"data.path={self.path!r} has no column {self.label_column!r}: set data.label_column to one of "
                    f"{', '.join(header)}."
                )
            at = header.index(self.label_column)
            try:
                features = np.array([[float(v) for i, v in enumerate(r) if i != at] for r in rows], dtype=np.float32)
            except ValueError as e:
                raise ConfigError(f"data.path={self.path!r}: every column but the label must be a number ({e}).")
            labels = np.unique([r[at] for r in rows], return_inverse=True)[1]
            return features, labels.astype(np.int64)
        import sklearn.datasets

        x, y = getattr(sklearn.datasets, f"load_{self.dataset}")(return_X_y=True)
        return x.astype(np.float32), y.astype(np.int64)

    @property
    def model_kwargs(self) -> dict[str, int]:
        return {"num_features": self.features.shape[1], "num_classes": int(self.labels.max()) + 1}

    def build_splits(self) -> dict[str, Dataset]:
        order = np.random.default_rng(0).permutation(len(self.labels))  # fixed: the splits never change
        x, y = self.features[order], self.labels[order]
        n_eval = self.val_size + self.test_size
        if n_eval >= len(y):
            raise ConfigError(f"data.val_size + data.test_size = {n_eval} leaves no training rows of {len(y)}.")
        train = x[n_eval:]
        x = (x - train.mean(0)) / train.std(0).clip(min=1e-6)
        rows = lambda a, b: TensorDataset(torch.from_numpy(a.astype(np.float32)), torch.from_numpy(b))  # noqa: E731
        splits = {
            "val": rows(x[: self.val_size], y[: self.val_size]),
            "test": rows(x[self.val_size : n_eval], y[self.val_size : n_eval]),
            "train": rows(x[n_eval:], y[n_eval:]),
        }
        log.info(f"{self.dataset}: {len(y) - n_eval}/{self.val_size}/{self.test_size} train/val/test rows")
        return splits
