"""Tokenize once, then memory-map: the nanoGPT `train.bin` idea, made safe for many ranks.

The cache file is keyed by a hash of the corpus content and the tokenizer, so editing the
corpus or switching tokenizers builds a new one; a warm start only stats the corpus files
(file_hashes.py). Who builds: in a training run Lightning's prepare_data runs on global rank 0
(data.cache_shared=true) or on local rank 0 of every node (false, for node-local cache dirs) while
the other ranks wait at its barrier, then find the finished cache without any lock. The lock here
only keeps separate jobs (sweeps, a second run) from building the same cache at once; where flock
fails (Lustre without -o flock, some NFS) it falls back to an O_EXCL lock file. The cache is written
under a temporary name and renamed, and its meta file written last, so nobody sees half a cache.
The build streams: pieces of text go to the tokenizer in bounded batches and the ids are appended
to the file, so memory does not grow with the corpus.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from filelock import FileLock, SoftFileLock

from src.lm.data.corpus import Corpus, CorpusError
from src.lm.data.tokenizers import Tokenizer, tokenizer_threads
from src.utils.config import ConfigError

log = logging.getLogger(__name__)

FORMAT_VERSION = "v2"  # bump when the on-disk layout or the key changes
BATCH_PIECES = 1024  # texts per tokenizer call: enough for the Rust tokenizer's threads to share
BATCH_CHARS = 8 << 20  # ... and at most this much text per call, so memory stays bounded


def cache_key(corpus: Corpus, tokenizer: Tokenizer, index_dir: Path | None = None) -> str:
    h = hashlib.sha256(f"{FORMAT_VERSION}|{corpus.fingerprint(index_dir)}|{tokenizer.fingerprint}".encode())
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
        raise ConfigError(
            f"The token cache dir {cache_dir} cannot be written ({e.strerror}): set paths.cache_dir "
            "(or data.cache_dir) to a writable dir."
        ) from None
    key = cache_key(corpus, tokenizer, cache_dir / "file-hashes")
    bin_path, meta_path = cache_dir / f"{key}.bin", cache_dir / f"{key}.json"
    if not meta_path.exists():  # the meta file is written last: its presence means the cache is complete
        with build_lock(cache_dir / f"{key}.lock"):
            if not meta_path.exists():
                _build(corpus, tokenizer, bin_path, meta_path)
    corpus.file_hashes.save()
    meta = json.loads(meta_path.read_text())
    return np.memmap(bin_path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["n_tokens"],))


@contextmanager
def build_lock(path: Path) -> Iterator[None]:
    """An flock between separate jobs; on a file system where flock fails, an O_EXCL lock file instead."""
    lock = FileLock(str(path))
    try:
        lock.acquire()
    except OSError as e:
        excl = Path(f"{path}.excl")
        log.warning(
            f"flock on {path} failed ({e.strerror or e}): locking with the O_EXCL file {excl} instead. "
            f"If a job was killed while building this cache and nothing else is building it, delete {excl}."
        )
        lock = SoftFileLock(str(excl))
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


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
        raise CorpusError(
            f"The corpus {corpus.description!r} is empty: it has no non-blank document. Point data.path at text."
        )
    os.replace(tmp, bin_path)
    meta = {
        "n_tokens": n_tokens,
        "n_docs": n_docs,
        "dtype": dtype.name,
        "source": corpus.description,
        "tokenizer": tokenizer.fingerprint,
    }
    meta_path.write_text(json.dumps(meta, indent=1))
    log.info(f"Tokenized {n_docs} documents into {n_tokens:,} tokens in {time.perf_counter() - t0:.1f}s -> {bin_path}")


def _write_tokens(corpus: Corpus, tokenizer: Tokenizer, dtype: np.dtype, tmp: Path) -> tuple[int, int]:
    """Append the token ids of the corpus's pieces to `tmp`, EOS after each document; a blank document is skipped."""
    n_tokens = n_docs = 0
    texts: list[str] = []
    ends: list[bool] = []

    def flush() -> None:
        nonlocal n_tokens, n_docs
        flat, lengths = tokenizer.encode_flat(texts)
        eos_at = np.cumsum(lengths)[np.asarray(ends, dtype=bool)]  # after the last piece of each document
        stream = np.insert(flat.astype(dtype, copy=False), eos_at, tokenizer.eos_id)
        out.write(stream.tobytes())
        n_tokens, n_docs = n_tokens + len(stream), n_docs + len(eos_at)
        texts.clear()
        ends.clear()

    with tmp.open("wb") as out, tokenizer_threads():
        chars, first_piece = 0, True
        for text, last in corpus.pieces():
            if first_piece and last and not text.strip():  # a blank document: no tokens, no EOS
                continue
            texts.append(text)
            ends.append(last)
            chars, first_piece = chars + len(text), last
            if len(texts) >= BATCH_PIECES or chars >= BATCH_CHARS:
                flush()
                chars = 0
        if texts:
            flush()
    return n_tokens, n_docs
