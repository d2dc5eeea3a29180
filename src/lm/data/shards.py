"""Token shards written by litdata (`python -m src.tools.shards build`), read back block by block from a
local dir or object storage (s3://, gs://): the data path for corpora one machine should not tokenize
alone or that live in a bucket.

Why litdata and how the template's guarantees survive: litdata's `optimize` tokenizes input files in
parallel worker processes (and on several machines) into chunk files, and its `StreamingDataset` gives
random access (`len`, `__getitem__`) to fixed-size token blocks, downloading the chunk a block lives in
on first use. We do not use litdata's own iteration (which deals whole chunks to ranks, so a global
batch would depend on the device count); the blocks go through our samplers instead, exactly like
`PackedBlocks` (src/lm/data/text.py): the same seeded permutation per epoch for every N, mid-epoch
resume by skipping, `ShardSampler` with padding for exact evaluation.

Blocks are packed at build time, not at read time: each input file is one token stream (documents
followed by EOS), cut into blocks of seq_len + 1 tokens that overlap by one, as `PackedBlocks` reads
them, so every token of a file but its first is a target exactly once. A file's last block is filled
with PAD (-1), stored as int32; the reader turns it into EOS inputs and ignored labels. Hence the shards
are built for one seq_len (recorded in shards.json, checked here), and a block never spans two files.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from src.core.datamodule import IGNORE_INDEX
from src.lm.data.text import split_blocks
from src.lm.data.tokenizers import load_tokenizer
from src.lm.data.tokens import TokenDataModule
from src.utils.config import ConfigError

log = logging.getLogger(__name__)
PAD = -1  # fills a file's last block; never a token id
META = "shards.json"  # what the shards were built with: seq_len, tokenizer, counts
TARGETS = "targets.npy"  # target tokens per block (seq_len but in each file's last block): the loss normaliser


def pack(tokens: Iterator[np.ndarray], seq_len: int) -> Iterator[np.ndarray]:
    """Blocks of seq_len + 1 tokens from a stream given in pieces, consecutive blocks overlapping by one;
    the last (if it has a target) filled with PAD. ceil((n - 1) / seq_len) blocks, as text.count_blocks."""
    buf = np.empty(0, dtype=np.int32)
    for piece in tokens:
        buf = np.concatenate([buf, piece.astype(np.int32)])
        n_full = (len(buf) - 1) // seq_len
        for j in range(n_full):
            yield buf[j * seq_len : j * seq_len + seq_len + 1].copy()
        buf = buf[n_full * seq_len :]
    if len(buf) > 1:
        yield np.concatenate([buf, np.full(seq_len + 1 - len(buf), PAD, dtype=np.int32)])


def read_documents(path: str, text_field: str) -> Iterator[str]:
    """A .jsonl file's `text_field` per line, or a .txt file's documents (split at blank lines)."""
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)[text_field]
                    except (json.JSONDecodeError, KeyError, TypeError) as e:
                        raise ValueError(f"{path}:{n}: not a JSON object with a {text_field!r} field ({e}).") from None
        else:
            doc: list[str] = []
            for line in f:
                if line.strip():
                    doc.append(line)
                elif doc:
                    yield "".join(doc)
                    doc = []
            if doc:
                yield "".join(doc)


def tokenize_file(
    path: str, tokenizer: str, seq_len: int, text_field: str = "text", batch_docs: int = 256
) -> Iterator[np.ndarray]:
    """litdata `optimize` fn: one input file -> its packed blocks (run in litdata's worker processes)."""
    tok = load_tokenizer(tokenizer)
    eos = np.array([tok.eos_id], dtype=np.int32)

    def streams() -> Iterator[np.ndarray]:
        batch: list[str] = []
        for doc in read_documents(path, text_field):
            if doc.strip():
                batch.append(doc)
            if len(batch) == batch_docs:
                yield from (np.concatenate([ids.astype(np.int32), eos]) for ids in tok.encode_batch(batch))
                batch = []
        if batch:
            yield from (np.concatenate([ids.astype(np.int32), eos]) for ids in tok.encode_batch(batch))

    yield from pack(streams(), seq_len)


class ShardBlocks(Dataset):
    """Blocks `first .. first+count-1` of the shards at `input_dir`, as {"input_ids", "labels"} (labels
    shifted, PAD positions ignored). The litdata reader is opened on first use, so the object pickles
    cheaply into DataLoader workers."""

    def __init__(
        self,
        input_dir: str,
        seq_len: int,
        first: int,
        count: int,
        eos_id: int,
        targets: np.ndarray,
        cache_dir: Optional[str] = None,
    ) -> None:
        self.input_dir, self.seq_len, self.first, self.count = input_dir, seq_len, first, count
        self.eos_id, self.targets, self.cache_dir = eos_id, targets, cache_dir
        self._reader = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_reader": None}

    @property
    def reader(self):
        if self._reader is None:
            self._reader = open_reader(self.input_dir, self.seq_len, self.cache_dir)
        return self._reader

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.count:
            raise IndexError(i)
        block = torch.as_tensor(np.asarray(self.reader[self.first + i]), dtype=torch.int64)
        ids, labels = block[:-1].clone(), block[1:].clone()
        ids[ids == PAD] = self.eos_id
        labels[labels == PAD] = IGNORE_INDEX
        return {"input_ids": ids, "labels": labels}

    def target_counts(self) -> np.ndarray:
        return self.targets[self.first : self.first + self.count]


def open_reader(input_dir: str, seq_len: int, cache_dir: Optional[str] = None):
    """litdata's random-access reader over blocks of seq_len + 1 tokens (chunks of a remote dir are
    downloaded to `cache_dir` on first use).

    Opened under a file lock on `cache_dir`: litdata 0.2's StreamingDataset deletes a cache dir that does not hold
    exactly its one version subdir before creating that subdir, so a rank that looks between another rank's two
    mkdirs deletes the other's parent and that rank fails (FileNotFoundError, seen in CI on 2 local ranks)."""
    import contextlib

    from filelock import FileLock
    from litdata import StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    lock: Any = contextlib.nullcontext()
    if cache_dir is not None:
        Path(cache_dir).parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(cache_dir).rstrip("/") + ".lock")
    with lock:
        return StreamingDataset(
            input_dir,
            item_loader=TokensLoader(block_size=seq_len + 1),
            shuffle=False,
            drop_last=False,
            cache_dir=cache_dir,
        )


def is_remote(input_dir: str) -> bool:
    """Object storage (s3://, gs://, ...) or litdata's `local:` stand-in for it, read through a cache."""
    return "://" in input_dir or input_dir.startswith("local:")


def read_small_file(input_dir: str, name: str) -> Optional[bytes]:
    """The bytes of `name` beside the shards (fetched fresh with litdata's downloader if remote), or None."""
    if not is_remote(input_dir):
        path = Path(input_dir) / name
        return path.read_bytes() if path.exists() else None
    import tempfile

    from litdata.streaming.downloader import get_downloader

    with tempfile.TemporaryDirectory() as tmp:  # per process: ranks never race on one file
        local = Path(tmp) / name
        try:
            get_downloader(input_dir, tmp, []).download_file(f"{input_dir.rstrip('/')}/{name}", str(local))
        except (FileNotFoundError, OSError):
            return None
        return local.read_bytes() if local.exists() else None


def chunk_cache(input_dir: str, cache_dir: Optional[str], meta: dict) -> Optional[str]:
    """Where a remote dir's chunks are downloaded: one subdir per (input_dir, build), so two datasets
    never share chunk names and rebuilt shards never meet stale chunks."""
    if not is_remote(input_dir) or cache_dir is None:
        return None
    key = hashlib.sha256(f"{input_dir}|{meta.get('built')}".encode()).hexdigest()[:16]
    return str(Path(cache_dir) / key)


class LitDataModule(TokenDataModule):
    """`data=litdata`: train on shards built by `python -m src.tools.shards build` (see module docstring); no
    data.special_tokens (the build tokenizes without them)."""

    def __init__(self, input_dir: Optional[str] = None, cache_dir: Optional[str] = None, **shared: Any) -> None:
        super().__init__(**shared)
        self.input_dir, self.cache_dir = input_dir, cache_dir

    def check_meta(self) -> dict:
        """The shards must have been built for this seq_len and tokenizer: say which rebuild is needed."""
        if not self.input_dir:  # checked here, not in __init__, so that the config composes without shards
            raise ConfigError(
                "data.input_dir is not set: point it at shards written by "
                "`python -m src.tools.shards build --output DIR` (a local dir or s3://...)."
            )
        self.input_dir = str(self.input_dir)
        raw = read_small_file(self.input_dir, META)
        if raw is None:
            raise ConfigError(
                f"data.input_dir={self.input_dir!r} has no {META}: build the shards there with "
                "`python -m src.tools.shards build --input ... --output DIR`."
            )
        meta = json.loads(raw)
        if meta["seq_len"] != self.seq_len:
            raise ConfigError(
                f"The shards in {self.input_dir!r} hold blocks for seq_len={meta['seq_len']}, not "
                f"data.seq_len={self.seq_len}: set data.seq_len={meta['seq_len']} or rebuild them "
                f"with --seq-len {self.seq_len}."
            )
        if meta["tokenizer"] != self.tokenizer.fingerprint:
            raise ConfigError(
                f"The shards in {self.input_dir!r} were tokenized with {meta['tokenizer_name']!r}, "
                f"not data.tokenizer={self.tokenizer_name!r}: set data.tokenizer to it or rebuild."
            )
        return meta

    def prepare_data(self) -> None:
        self.check_meta()  # fails on local rank 0 with one sentence rather than in every rank's setup()

    def build_splits(self) -> dict[str, Dataset]:
        meta = self.check_meta()
        targets = np.load(io.BytesIO(read_small_file(self.input_dir, TARGETS)), allow_pickle=False)  # data, never code
        n_train, n_val, n_test = split_blocks(len(targets), self.val_fraction, self.test_fraction)
        log.info(
            f"{self.input_dir}: {int(targets.sum()):,} target tokens in {len(targets):,} blocks of "
            f"{self.seq_len} -> {n_train}/{n_val}/{n_test} train/val/test; micro-batch {self.batch_size}, "
            f"global batch {self.global_batch_size}"
        )
        cache = chunk_cache(self.input_dir, self.cache_dir, meta)

        def make(first: int, count: int) -> ShardBlocks:
            return ShardBlocks(self.input_dir, self.seq_len, first, count, self.tokenizer.eos_id, targets, cache)

        return {"train": make(0, n_train), "val": make(n_train, n_val), "test": make(n_train + n_val, n_test)}


def block_targets(input_dir: str, seq_len: int) -> np.ndarray:
    """Target tokens per block, read once after a build (the build's last step writes it as TARGETS)."""
    reader = open_reader(input_dir, seq_len)
    return np.array([int((np.asarray(reader[i])[1:] != PAD).sum()) for i in range(len(reader))], dtype=np.int32)


def input_files(root: str) -> list[str]:
    """The .txt / .jsonl files at `root` (a file or a dir, searched recursively), sorted."""
    if os.path.isfile(root):
        return [root]
    files = sorted(str(p) for p in Path(root).rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file())
    if not files:
        raise FileNotFoundError(f"--input {root!r} holds no .txt or .jsonl file: point it at text files.")
    return files
