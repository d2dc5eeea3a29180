"""Causal-LM data: a token stream packed into fixed `seq_len` blocks, split train/val/test.

Packing: documents are joined with EOS and cut into consecutive blocks, so long documents
are split across blocks, never truncated, and no token is lost (the last, partial block is
padded, and its padding is masked out of the loss with label -100).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from functools import cached_property
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from src.datamodules.base import ShardedDataModule
from src.datamodules.corpus import Corpus, CorpusError
from src.datamodules.token_cache import load_or_build
from src.datamodules.tokenizers import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)
IGNORE_INDEX = -100  # label value that torch's cross-entropy (and HF models) skip


class PackedBlocks(Dataset):
    """Blocks `first .. first+count-1` of `seq_len` tokens each from a flat token stream."""

    def __init__(self, tokens: np.ndarray, seq_len: int, first: int, count: int, pad_id: int) -> None:
        self.tokens, self.seq_len, self.first, self.count, self.pad_id = tokens, seq_len, first, count, pad_id

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.count:
            raise IndexError(i)
        start = (self.first + i) * self.seq_len
        ids = torch.from_numpy(self.tokens[start : start + self.seq_len].astype(np.int64))
        labels = ids.clone()
        if len(ids) < self.seq_len:  # only the very last block of the stream
            pad = self.seq_len - len(ids)
            ids = torch.cat([ids, torch.full((pad,), self.pad_id)])
            labels = torch.cat([labels, torch.full((pad,), IGNORE_INDEX)])
        return {"input_ids": ids, "labels": labels}


def split_blocks(n_blocks: int, val_fraction: float, test_fraction: float) -> tuple[int, int, int]:
    """(train, val, test) block counts; val and test are contiguous at the end, so no block leaks."""
    n_val = max(1, round(n_blocks * val_fraction)) if val_fraction > 0 else 0
    n_test = max(1, round(n_blocks * test_fraction)) if test_fraction > 0 else 0
    n_train = n_blocks - n_val - n_test
    if n_train < 1:
        raise CorpusError(
            f"The corpus makes only {n_blocks} block(s) of seq_len tokens: too few for a train split plus "
            f"{n_val} val and {n_test} test block(s). Use more text or a smaller data.seq_len."
        )
    return n_train, n_val, n_test


class TextDataModule(ShardedDataModule):
    def __init__(
        self,
        path: Optional[str] = None,
        hf_dataset: Optional[str] = None,
        hf_split: str = "train",
        text_field: str = "text",
        tokenizer: str = "bytes",
        seq_len: int = 128,
        global_batch_size: int = 32,
        eval_batch_size: Optional[int] = None,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        num_workers: int = 0,
        cache_dir: str = ".cache/tokens",
        seed: int = 42,
        special_tokens: Sequence[str] = (),
    ) -> None:
        super().__init__(global_batch_size, eval_batch_size, num_workers, seed)
        self.path, self.hf_dataset, self.hf_split, self.text_field = path, hf_dataset, hf_split, text_field
        self.tokenizer_name, self.seq_len = tokenizer, seq_len
        self.val_fraction, self.test_fraction, self.cache_dir = val_fraction, test_fraction, cache_dir
        self.special_tokens = list(special_tokens)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.tokenizer_name, self.special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def tokens(self) -> np.ndarray:
        corpus = Corpus.from_config(self.path, self.hf_dataset, self.hf_split, self.text_field)
        return load_or_build(corpus, self.tokenizer, self.cache_dir)

    def prepare_data(self) -> None:
        self.tokens()  # build the cache once (local rank 0); other ranks find it in setup()

    @property
    def model_kwargs(self) -> dict[str, int]:
        """What the model must be built with to fit this data (train.py passes it to the model)."""
        return {"vocab_size": self.vocab_size}

    def build_splits(self) -> dict[str, PackedBlocks]:
        tokens = self.tokens()
        n_train, n_val, n_test = split_blocks(math.ceil(len(tokens) / self.seq_len), self.val_fraction,
                                              self.test_fraction)
        eos = self.tokenizer.eos_id
        log.info(f"{len(tokens):,} tokens -> {n_train}/{n_val}/{n_test} train/val/test blocks of {self.seq_len}; "
                 f"micro-batch {self.batch_size}, global batch {self.global_batch_size}")
        return {
            "train": PackedBlocks(tokens, self.seq_len, 0, n_train, eos),
            "val": PackedBlocks(tokens, self.seq_len, n_train, n_val, eos),
            "test": PackedBlocks(tokens, self.seq_len, n_train + n_val, n_test, eos),
        }
