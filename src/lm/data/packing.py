"""Packing (`data.packing=true`): several records in one row of at most seq_len tokens, attention never crossing
them, for data=chat and data=instruct.

Rows are filled in the records' order, each record whole (next fit: a record that does not fit starts a new
row), so the packing is data, the same for any number of ranks, and a record's tokens are never split. Each
record's position ids restart at 0: transformers' masking (`find_packed_sequence_indices`, when a forward gets
position ids and no attention mask or cache) then gives every record a causal mask of its own, block-diagonal
over the row, on CPU (SDPA, eager) as on a GPU (FlashAttention's variable-length path). A record keeps its shifted
labels, so no target crosses a record either. `CausalLMLitModule` proves the model's forward honours it before
step 1 (a packed probe against each record alone).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from src.lm.data.records import right_padded
from src.lm.data.text import IGNORE_INDEX

Record = tuple[np.ndarray, np.ndarray]  # (input_ids, labels), labels shifted


def pack(items: list[Record], seq_len: int) -> list[list[int]]:
    """The rows: lists of record indices, in order, each row's tokens at most seq_len."""
    rows: list[list[int]] = []
    used = seq_len + 1
    for i, (ids, _) in enumerate(items):
        if used + len(ids) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += len(ids)
    return rows


Row = dict[str, np.ndarray]  # "input_ids", "labels" (shifted), "position_ids"


class PackedRows(Dataset):
    """Item i: row i, its records concatenated, as a dict: named fields, so evaluation's padding item
    (src/core/datamodule.py ignore_labels) blanks the labels and nothing else."""

    def __init__(self, items: list[Record], seq_len: int) -> None:
        self.rows: list[Row] = [
            {
                "input_ids": np.concatenate([items[j][0] for j in row]),
                "labels": np.concatenate([items[j][1] for j in row]),
                "position_ids": np.concatenate([np.arange(len(items[j][0])) for j in row]),
            }
            for row in pack(items, seq_len)
        ]
        self.records = len(items)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Row:
        return self.rows[i]

    def target_counts(self) -> np.ndarray:
        return np.array([(row["labels"] != IGNORE_INDEX).sum() for row in self.rows], dtype=np.int64)


def packed_collate(pad_id: int):
    """Rows padded to the batch's longest; the padding is a record of its own (positions from 0), never a target.
    No attention mask: the position ids say where each record starts."""

    def collate(batch: list[Row]) -> dict[str, torch.Tensor]:
        input_ids = right_padded([row["input_ids"] for row in batch], pad_id)
        labels = right_padded([row["labels"] for row in batch], IGNORE_INDEX)
        longest = input_ids.shape[1]
        positions = torch.arange(longest).repeat(len(batch), 1)
        for i, row in enumerate(batch):
            n = len(row["input_ids"])
            positions[i, :n] = torch.from_numpy(row["position_ids"])
            positions[i, n:] = torch.arange(longest - n)
        return {"input_ids": input_ids, "labels": labels, "position_ids": positions}

    return collate


def padding_share(lengths: np.ndarray, batch: int) -> float:
    """The share of a padded batch's positions that are padding, batches of `batch` records in order."""
    lengths = np.asarray(lengths)
    n = len(lengths) // batch * batch
    if n == 0:
        return 0.0
    longest = lengths[:n].reshape(-1, batch).max(1)
    return float(1 - lengths[:n].sum() / (longest.sum() * batch))
