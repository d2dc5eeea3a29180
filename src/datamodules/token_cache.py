"""Tokenize once, then memory-map: the nanoGPT `train.bin` idea, made safe for many ranks.

The cache file is keyed by a hash of the corpus content and the tokenizer, so editing the
corpus or switching tokenizers builds a new one. A file lock lets exactly one process
build it while the others (ranks, sweep jobs) wait and then read; the file is written
under a temporary name and renamed, so a reader never sees half a cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
from filelock import FileLock

from src.datamodules.corpus import Corpus, CorpusError
from src.datamodules.tokenizers import Tokenizer
from src.utils.config import ConfigError

log = logging.getLogger(__name__)

FORMAT_VERSION = "v1"  # bump when the on-disk layout changes
BATCH_DOCS = 256  # documents per tokenizer call: large enough for Rust-side parallelism, small enough for RAM


def cache_key(corpus: Corpus, tokenizer: Tokenizer) -> str:
    h = hashlib.sha256(f"{FORMAT_VERSION}|{corpus.fingerprint()}|{tokenizer.fingerprint}".encode())
    return h.hexdigest()[:20]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def load_or_build(corpus: Corpus, tokenizer: Tokenizer, cache_dir: str | os.PathLike) -> np.memmap:
    """The corpus as one flat token stream, documents separated by EOS, memory-mapped."""
    cache_dir = Path(cache_dir)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        (cache_dir / f".write_test{os.getpid()}").touch()
        (cache_dir / f".write_test{os.getpid()}").unlink()
    except OSError as e:
        raise ConfigError(f"The token cache dir {cache_dir} cannot be written ({e.strerror}): set paths.cache_dir "
                          "(or data.cache_dir) to a writable dir.") from None
    key = cache_key(corpus, tokenizer)
    bin_path, meta_path = cache_dir / f"{key}.bin", cache_dir / f"{key}.json"
    with FileLock(str(cache_dir / f"{key}.lock")):
        if not meta_path.exists():  # the meta file is written last: its presence means the cache is complete
            _build(corpus, tokenizer, bin_path, meta_path)
    meta = json.loads(meta_path.read_text())
    return np.memmap(bin_path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["n_tokens"],))


def _build(corpus: Corpus, tokenizer: Tokenizer, bin_path: Path, meta_path: Path) -> None:
    t0 = time.perf_counter()
    dtype = token_dtype(tokenizer.vocab_size)
    tmp = bin_path.with_suffix(f".tmp{os.getpid()}")
    try:  # a bad record, a full disk or Ctrl+C leaves no partial file behind
        n_tokens, n_docs = _write_tokens(corpus, tokenizer, dtype, tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if n_docs == 0:
        tmp.unlink()
        raise CorpusError(f"The corpus {corpus.description!r} is empty: it has no non-blank document. "
                          "Point data.path at text.")
    os.replace(tmp, bin_path)
    meta = {"n_tokens": n_tokens, "n_docs": n_docs, "dtype": dtype.name, "source": corpus.description,
            "tokenizer": tokenizer.fingerprint}
    meta_path.write_text(json.dumps(meta, indent=1))
    log.info(f"Tokenized {n_docs} documents into {n_tokens:,} tokens in {time.perf_counter() - t0:.1f}s -> {bin_path}")


def _write_tokens(corpus: Corpus, tokenizer: Tokenizer, dtype: np.dtype, tmp: Path) -> tuple[int, int]:
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    n_tokens = n_docs = 0
    with tmp.open("wb") as out:
        batch: list[str] = []
        docs = corpus.documents()
        while True:
            doc = next(docs, None)
            if doc is not None and doc.strip():
                batch.append(doc)
            if batch and (doc is None or len(batch) == BATCH_DOCS):
                for ids in tokenizer.encode_batch(batch):
                    out.write(ids.astype(dtype).tobytes())
                    out.write(eos.tobytes())
                    n_tokens += len(ids) + 1
                n_docs += len(batch)
                batch = []
            if doc is None:
                break
    return n_tokens, n_docs
