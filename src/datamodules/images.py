"""Small image classification data for the vision path (and its BatchNorm): digits or MNIST.

`digits` is scikit-learn's bundled 8x8 handwritten digits (1797 images): offline, no download.
`mnist` reads the original IDX files (optionally .gz) from `path`. When the training images are
missing (as in ../shared/data/mnist, which has the 10k test split only), the test split is split
into train/val/test instead.
"""

from __future__ import annotations

import gzip
import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from src.core.datamodule import ShardedDataModule

log = logging.getLogger(__name__)


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (LeCun's MNIST format: big-endian magic, dims, then uint8 data), plain or .gz."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[:4], "big")
    if magic >> 8 != 0x08:  # 0x0008XX: unsigned bytes, XX dimensions
        raise ValueError(f"{path} is not an unsigned-byte IDX file (magic {magic:#x}).")
    ndim = magic & 0xFF
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    array = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if array.size != int(np.prod(dims)):
        raise ValueError(f"{path} is truncated: header says {dims}, found {array.size} values.")
    return array.reshape(dims)


def find_idx(root: Path, stem: str) -> Optional[Path]:
    for name in (stem, stem + ".gz"):
        if (root / name).is_file():
            return root / name
    return None


def load_mnist(path: str) -> tuple[tuple[np.ndarray, np.ndarray], Optional[tuple[np.ndarray, np.ndarray]]]:
    """((test images, labels), (train images, labels) or None when the train files are absent)."""
    root = Path(path).expanduser()
    test_x, test_y = find_idx(root, "t10k-images-idx3-ubyte"), find_idx(root, "t10k-labels-idx1-ubyte")
    if test_x is None or test_y is None:
        raise FileNotFoundError(
            f"data.path={path!r} has no t10k-images-idx3-ubyte[.gz] / t10k-labels-idx1-ubyte[.gz]. "
            "Point data.path at a dir with the MNIST IDX files, or use data=digits (offline)."
        )
    test = (read_idx(test_x), read_idx(test_y))
    train_x, train_y = find_idx(root, "train-images-idx3-ubyte"), find_idx(root, "train-labels-idx1-ubyte")
    train = (read_idx(train_x), read_idx(train_y)) if train_x and train_y else None
    return test, train


class ImageDataModule(ShardedDataModule):
    batch_kind = "images"

    def __init__(
        self,
        dataset: str = "digits",
        path: Optional[str] = None,
        val_size: int = 200,
        test_size: int = 200,
        global_batch_size: int = 64,
        **shared: Any,
    ) -> None:
        super().__init__(global_batch_size, **shared)
        if dataset not in ("digits", "mnist"):
            raise ValueError(f"data.dataset={dataset!r}: use digits or mnist.")
        self.dataset, self.path, self.val_size, self.test_size = dataset, path, val_size, test_size

    @property
    def model_kwargs(self) -> dict[str, int]:
        return {"in_channels": 1, "num_classes": 10}

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, Optional[tuple[np.ndarray, np.ndarray]]]:
        if self.dataset == "digits":
            from sklearn.datasets import load_digits

            digits = load_digits()
            return digits.images / 16.0, digits.target, None
        (x, y), train = load_mnist(self.path)
        train = None if train is None else (train[0] / 255.0, train[1])
        return x / 255.0, y, train

    def build_splits(self) -> dict[str, Dataset]:
        x, y, train = self._arrays()
        # A fixed shuffle (not the training seed): the splits never change between runs.
        order = np.random.default_rng(0).permutation(len(x))
        x, y = x[order], y[order]
        n_eval = self.val_size + self.test_size
        if n_eval >= len(x) and train is None:
            raise ValueError(f"val_size + test_size = {n_eval} leaves no training images of {len(x)}.")
        tensors = lambda a, b: TensorDataset(torch.tensor(a, dtype=torch.float32)[:, None], torch.tensor(b))  # noqa
        val = tensors(x[: self.val_size], y[: self.val_size])
        test = tensors(x[self.val_size : n_eval], y[self.val_size : n_eval])
        train_set = tensors(*train) if train is not None else tensors(x[n_eval:], y[n_eval:])
        log.info(f"{self.dataset}: {len(train_set)}/{len(val)}/{len(test)} train/val/test images")
        return {"train": train_set, "val": val, "test": test}
