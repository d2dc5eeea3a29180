"""Random augmentation in a Dataset's `__getitem__` (random crops, flips, noise: torch's, numpy's and Python's global
generators) drawn the same for a sample on 1 process and on N ranks.

A loader's items come from each rank's (or each worker's) own generators, so on N ranks a sample gets other draws
than on 1 and the run trains another model. Here each item is read under generators seeded from (the run's seed, the
epoch, the sample's index in the dataset) and restored after it (`SeededItems`): sample i of epoch e is augmented
alike on any layout, in the main process or a loader worker, a new draw each epoch, the same again on a resume. The
training sampler hands the epoch along with each index (`ResumableDistributedSampler.with_epoch`), so persistent
workers, whose copy of the dataset never sees a new epoch, key by the right one. Evaluation items are keyed by their
index alone. What is not keyed: a generator the Dataset keeps itself (`self.rng = np.random.default_rng(0)`, each
rank's copy advancing through its own share) and `np.random.default_rng()` unseeded; draw from the global ones.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Optional, Union

import numpy as np
import torch
from torch.utils.data import Dataset

EVALUATION = -1  # the "epoch" evaluation items are keyed by


def item_seed(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed for sample `index` in `epoch` of a run seeded `seed`: a hash, so neighbours are unrelated."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class SeededItems(Dataset):
    """`dataset` whose item is read under torch's, numpy's and Python's global generators seeded by item_seed and
    restored after it. Indexed by (epoch, index) pairs (the training sampler's `with_epoch`) or by an index alone
    (evaluation: EVALUATION's key)."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Union[int, tuple[int, int]]) -> Any:
        epoch, index = key if isinstance(key, tuple) else (EVALUATION, key)
        with seeded(item_seed(self.seed, epoch, index)):
            return self.dataset[index]

    def __getattr__(self, name: str) -> Any:  # the user's dataset's own attributes (classes, transforms...)
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


class seeded:
    """Within: torch's (CPU), numpy's and Python's global generators seeded from `seed`; after: as they were."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.saved: Optional[tuple] = None

    def __enter__(self) -> None:
        self.saved = (torch.get_rng_state(), np.random.get_state(), random.getstate())
        torch.manual_seed(self.seed)
        np.random.seed(self.seed & 0xFFFFFFFF)
        random.seed(self.seed)

    def __exit__(self, *exc: Any) -> None:
        torch_state, numpy_state, python_state = self.saved
        torch.set_rng_state(torch_state)
        np.random.set_state(numpy_state)
        random.setstate(python_state)
