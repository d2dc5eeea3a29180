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

from src.datamodules.text import IGNORE_INDEX

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


class PackedRows(Dataset):
    """Item i: (input_ids, labels, position_ids) of row i, its records concatenated."""

    def __init__(self, items: list[Record], seq_len: int) -> None:
        self.rows = [
            (
                np.concatenate([items[j][0] for j in row]),
                np.concatenate([items[j][1] for j in row]),
                np.concatenate([np.arange(len(items[j][0])) for j in row]),
            )
            for row in pack(items, seq_len)
        ]
        self.records = len(items)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.rows[i]

    def target_counts(self) -> np.ndarray:
        return np.array([(labels != IGNORE_INDEX).sum() for _, labels, _ in self.rows], dtype=np.int64)


def packed_collate(pad_id: int):
    """Rows padded to the batch's longest; the padding is a record of its own (positions from 0), never a target.
    No attention mask: the position ids say where each record starts."""

    def collate(batch: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
        longest = max(len(ids) for ids, _, _ in batch)
        input_ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), longest), IGNORE_INDEX, dtype=torch.long)
        positions = torch.arange(longest).repeat(len(batch), 1)
        for row, (ids, lab, pos) in enumerate(batch):
            n = len(ids)
            input_ids[row, :n], labels[row, :n] = torch.from_numpy(ids), torch.from_numpy(lab)
            positions[row, :n] = torch.from_numpy(pos)
            positions[row, n:] = torch.arange(longest - n)
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
