"""Data read whole from one file of records (data=instruct, chat, preference, prompts): RecordsDataModule, the cut of
its items into train, val and test in file order, and the helpers of their token batches (right padding, label
targets)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from src.lm.data.tokens import TokenDataModule, split_counts
from src.utils.labels import IGNORE_INDEX


class Items(Dataset):
    """A split held in memory: a list of samples (records, pairs, prompts) and each one's number of targets, the
    loss normaliser (LitModule.token_mean_loss): given (a record's label tokens), or one per sample (pairs, prompts:
    the loss is a mean over them)."""

    def __init__(self, items: list, targets: Optional[list[int]] = None) -> None:
        self.items = items
        self.targets = np.ones(len(items), dtype=np.int64) if targets is None else np.asarray(targets, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]

    def target_counts(self) -> np.ndarray:
        return self.targets


def right_padded(rows: list[np.ndarray], value: int) -> torch.Tensor:
    """(len(rows), longest) int64: each row from position 0, then `value` (right padding keeps each real token's
    position)."""
    out = torch.full((len(rows), max(len(row) for row in rows)), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.from_numpy(np.asarray(row))
    return out


def padded_records(rows: list[tuple[np.ndarray, np.ndarray]], pad_id: int) -> dict[str, torch.Tensor]:
    """(input ids, labels) records as one right-padded batch: padding is `pad_id` in the inputs, never a target,
    and masked out of attention."""
    return {
        "input_ids": right_padded([ids for ids, _ in rows], pad_id),
        "labels": right_padded([labels for _, labels in rows], IGNORE_INDEX),
        "attention_mask": right_padded([np.ones(len(ids), dtype=np.int64) for ids, _ in rows], 0),
    }


def label_targets(items: list[tuple[np.ndarray, np.ndarray]]) -> list[int]:
    """Each (input ids, labels) record's target tokens."""
    return [int((labels != IGNORE_INDEX).sum()) for _, labels in items]


def split_sizes(n: int, val_fraction: float, test_fraction: float, where: str, unit: str) -> tuple[int, int, int]:
    """(train, val, test) counts of `n` records in file order, val and test at least one each when asked for; one
    sentence when no training record is left."""
    return split_counts(
        n, val_fraction, test_fraction,
        lambda n_val, n_test: f"{where}: {n} usable {unit}(s) are too few for a train split plus {n_val} val and "
        f"{n_test} test {unit}(s): add {unit}s or lower data.val_fraction / data.test_fraction.",
    )  # fmt: skip


class RecordsDataModule(TokenDataModule):
    """Data read whole from one file of records (instruct, chat, preference, prompts): data.path (or hf:<name> and
    its data.hf_split), data.special_tokens added to its tokenizer, the records checked on rank 0 before any rank's
    setup, and the cut of the usable items into train, val and test in file order. Each subclass takes its own keys
    and its seq_len's default, and passes the rest on (`**shared`)."""

    def __init__(
        self,
        path: str,
        hf_split: str = "train",
        special_tokens: Sequence[str] = (),
        global_batch_size: int = 8,
        **shared: Any,
    ) -> None:
        super().__init__(global_batch_size=global_batch_size, **shared)
        self.path, self.hf_split, self.special_tokens = path, hf_split, list(special_tokens)

    def records(self) -> list:
        """The file's records, parsed; a bad one raises its one sentence."""
        raise NotImplementedError

    def prepare_data(self) -> None:
        self.records()  # bad records fail here, on rank 0 alone, rather than in every rank's setup()

    def cut_splits(self, items: list, unit: str) -> dict[str, list]:
        """`items` in file order as {"train", "val", "test"} (split_sizes' counts)."""
        n_train, n_val, _ = split_sizes(len(items), self.val_fraction, self.test_fraction, self.path, unit)
        return {"train": items[:n_train], "val": items[n_train : n_train + n_val], "test": items[n_train + n_val :]}
