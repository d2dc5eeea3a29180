"""Causal-LM data: a token stream packed into fixed `seq_len` blocks, split train/val/test.

Packing: documents are joined with EOS and cut into consecutive blocks, so long documents
are split across blocks, never truncated, and no token is lost: every token after the stream's
first is a target exactly once (blocks overlap by one token; the last, partial block is padded,
and its padding is masked out of the loss with label -100).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset

from src.lm.data.corpus import Corpus, CorpusError
from src.lm.data.token_cache import load_or_build
from src.lm.data.tokens import TokenDataModule, split_counts
from src.utils.config import ConfigError, check_int
from src.utils.labels import IGNORE_INDEX

log = logging.getLogger(__name__)


class PackedBlocks(Dataset):
    """Blocks `first .. first+count-1` of a flat token stream: block j reads the seq_len + 1 tokens
    from j * seq_len on (consecutive blocks overlap by one), inputs are its first seq_len and labels
    the next seq_len. Labels are already shifted (labels[t] is the token that follows inputs[t], the
    convention of all data here), so every token after the stream's first is a target exactly once."""

    def __init__(self, tokens: np.ndarray, seq_len: int, first: int, count: int, pad_id: int) -> None:
        self.tokens, self.seq_len, self.first, self.count, self.pad_id = tokens, seq_len, first, count, pad_id

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.count:
            raise IndexError(i)
        start = (self.first + i) * self.seq_len
        chunk = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        ids, labels = chunk[: self.seq_len], chunk[1:]
        if len(labels) < self.seq_len:  # only the very last block of the stream
            ids = torch.cat([ids, torch.full((self.seq_len - len(ids),), self.pad_id)])
            labels = torch.cat([labels, torch.full((self.seq_len - len(labels),), IGNORE_INDEX)])
        return {"input_ids": ids, "labels": labels}

    def target_counts(self) -> np.ndarray:
        """Target tokens per block (seq_len, fewer in the stream's last block): the loss normaliser.
        Where every block is full (any split but the one holding the stream's end), one value broadcast
        over all blocks: no memory per block."""
        if (self.first + self.count) * self.seq_len <= len(self.tokens) - 1:
            return np.broadcast_to(np.int64(self.seq_len), (self.count,))
        starts = (self.first + np.arange(self.count, dtype=np.int64)) * self.seq_len
        return np.minimum(self.seq_len, len(self.tokens) - 1 - starts)


def count_blocks(n_tokens: int, seq_len: int) -> int:
    """Blocks needed so that every token but the first is a target once (the first has no context)."""
    return math.ceil((n_tokens - 1) / seq_len)


class WeightedMix(Dataset):
    """Training blocks drawn from several sources in proportion to their weights, so a large corpus
    does not drown a small one: small sources repeat, large ones are subsampled. One epoch has as
    many samples as all sources together; the draw is fixed by the seed."""

    def __init__(self, datasets: list[Dataset], weights: list[float], seed: int) -> None:
        if len(datasets) != len(weights) or any(w <= 0 for w in weights):
            raise ValueError(f"data.mix weights must be positive numbers, one per source; got {weights}.")
        self.datasets = datasets
        rng = np.random.default_rng(seed)
        n = sum(len(d) for d in datasets)
        self.source = rng.choice(len(datasets), size=n, p=np.asarray(weights) / sum(weights))
        self.index = np.empty(n, dtype=np.int64)
        for s, dataset in enumerate(datasets):  # each source's blocks in a shuffled cycle
            where = np.flatnonzero(self.source == s)
            cycles = -(-len(where) // len(dataset))
            self.index[where] = np.concatenate([rng.permutation(len(dataset)) for _ in range(cycles)])[: len(where)]

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int):
        return self.datasets[self.source[i]][self.index[i]]

    def target_counts(self) -> np.ndarray:
        counts = np.empty(len(self.source), dtype=np.int64)
        for s, dataset in enumerate(self.datasets):
            where = self.source == s
            counts[where] = dataset.target_counts()[self.index[where]]
        return counts


def split_blocks(n_blocks: int, val_fraction: float, test_fraction: float) -> tuple[int, int, int]:
    """(train, val, test) block counts; val and test are contiguous at the end, so no block leaks."""
    return split_counts(
        n_blocks, val_fraction, test_fraction,
        lambda n_val, n_test: f"The corpus makes only {n_blocks} block(s) of seq_len tokens: too few for a train "
        f"split plus {n_val} val and {n_test} test block(s). Use more text or a smaller data.seq_len.",
    )  # fmt: skip


class TextDataModule(TokenDataModule):
    def __init__(
        self,
        path: Optional[str] = None,
        hf_dataset: Optional[str] = None,
        hf_split: str = "train",
        text_field: str = "text",
        cache_dir: str = ".cache/tokens",
        special_tokens: Sequence[str] = (),
        mix: Optional[list[dict]] = None,
        hf_streaming: bool = False,
        txt_chunk_chars: int = 1 << 18,
        cache_shared: bool = True,
        **shared: Any,
    ) -> None:
        super().__init__(**shared)
        self.path, self.hf_dataset, self.hf_split, self.text_field = path, hf_dataset, hf_split, text_field
        self.cache_dir, self.special_tokens = cache_dir, list(special_tokens)
        self.hf_streaming, self.txt_chunk_chars = hf_streaming, txt_chunk_chars
        check_int("data.txt_chunk_chars", txt_chunk_chars)
        # Who runs prepare_data (the cache build) while the other ranks wait at Lightning's barrier:
        # global rank 0 for a cache dir every node sees, local rank 0 of each node for node-local disks.
        self.prepare_data_per_node = not cache_shared
        self.mix = [dict(m) for m in mix or []]
        for m in self.mix:
            if set(m) != {"path", "weight"}:
                raise ConfigError(f"data.mix entries need exactly 'path' and 'weight'; got {sorted(m)}.")
            if isinstance(m["weight"], bool) or not isinstance(m["weight"], (int, float)) or m["weight"] <= 0:
                raise ConfigError(f"data.mix: weight={m['weight']!r} of {m['path']!r} must be a positive number.")
        if self.mix and (path or hf_dataset):
            raise ConfigError("Set data.mix or data.path / data.hf_dataset, not both.")

    def tokens(self, path: Optional[str] = None) -> np.ndarray:
        corpus = Corpus.from_config(
            path or self.path,
            None if path else self.hf_dataset,
            self.hf_split,
            self.text_field,
            self.hf_streaming,
            self.txt_chunk_chars,
        )
        return load_or_build(corpus, self.tokenizer, self.cache_dir)

    def prepare_data(self) -> None:
        for path in [m["path"] for m in self.mix] or [None]:
            tokens = self.tokens(path)  # build the caches once (see __init__: which rank); others find them in setup()
            try:  # too little text fails here, on rank 0 alone, rather than in every rank's setup()
                split_blocks(count_blocks(len(tokens), self.seq_len), self.val_fraction, self.test_fraction)
            except CorpusError as e:
                raise CorpusError(f"{path or self.path or self.hf_dataset or 'The embedded corpus'}: {e}") from None

    def _splits_of(self, path: Optional[str]) -> dict[str, PackedBlocks]:
        tokens = self.tokens(path)
        n_train, n_val, n_test = split_blocks(
            count_blocks(len(tokens), self.seq_len), self.val_fraction, self.test_fraction
        )
        eos = self.tokenizer.eos_id
        log.info(
            f"{path or self.path or 'corpus'}: {len(tokens):,} tokens -> {n_train}/{n_val}/{n_test} "
            f"train/val/test blocks of {self.seq_len}; micro-batch {self.batch_size}, "
            f"global batch {self.global_batch_size}"
        )
        return {
            "train": PackedBlocks(tokens, self.seq_len, 0, n_train, eos),
            "val": PackedBlocks(tokens, self.seq_len, n_train, n_val, eos),
            "test": PackedBlocks(tokens, self.seq_len, n_train + n_val, n_test, eos),
        }

    def build_splits(self) -> dict[str, Dataset]:
        if not self.mix:
            return self._splits_of(None)
        parts = [self._splits_of(m["path"]) for m in self.mix]
        # Training follows the weights; val and test keep every block of every source, once.
        return {
            "train": WeightedMix([p["train"] for p in parts], [float(m["weight"]) for m in self.mix], self.seed or 0),
            "val": ConcatDataset([p["val"] for p in parts]),
            "test": ConcatDataset([p["test"] for p in parts]),
        }
