"""Tokenizers behind one small interface: `encode_batch`, `decode`, `vocab_size`, `eos_id`, `fingerprint`.

`bytes` is the offline default: UTF-8 bytes are the tokens (ids 0..255) and 256 is EOS,
so it needs no download and no training. Anything else is a Hugging Face tokenizer from a
local dir or a hub name.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import numpy as np

from src.utils.config import ConfigError
from src.utils.errors import PathNotFound


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    fingerprint: str  # changes whenever the ids it produces could change

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]: ...  # (ids of all texts, lengths)

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    vocab_size = 257
    eos_id = 256
    fingerprint = "bytes-v1"

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """All texts' bytes in one array (one join, no per-document arrays) and each text's length."""
        data = [t.encode("utf-8") for t in texts]
        return np.frombuffer(b"".join(data), dtype=np.uint8), np.fromiter(map(len, data), np.int64, len(data))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `transformers` fast tokenizer; batch encoding runs in Rust, off the training loop."""

    def __init__(self, name_or_path: str, special_tokens: Sequence[str] = ()) -> None:
        self.hf = load_hf_tokenizer(name_or_path)
        if special_tokens:  # new ids at the end of the vocabulary; the model resizes its embeddings to match
            self.hf.add_special_tokens({"additional_special_tokens": list(special_tokens)})
        if self.hf.eos_token_id is None:
            raise ConfigError(
                f"data.tokenizer={name_or_path!r} has no EOS token, so documents could not be "
                "separated: use a tokenizer with one (e.g. GPT-2's) or data.tokenizer=bytes."
            )
        self.vocab_size = len(self.hf)
        self.eos_id = int(self.hf.eos_token_id)
        state = self.hf.backend_tokenizer.to_str() if self.hf.is_fast else repr(sorted(self.hf.get_vocab().items()))
        self.fingerprint = "hf-" + hashlib.sha256(state.encode()).hexdigest()[:16]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        ids = self.hf(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        return [np.asarray(x, dtype=np.int64) for x in ids]

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The same ids as encode_batch, from the Rust tokenizer directly (no offsets, no per-text arrays)."""
        backend = self.hf.backend_tokenizer
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        ids = [e.ids for e in encode(texts, add_special_tokens=False)]
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        return np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(lengths.sum())), lengths

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids)


@contextmanager
def tokenizer_threads() -> Iterator[None]:
    """Let the Rust tokenizer encode a batch on all cores (its rayon pool; RAYON_NUM_THREADS caps it) while the
    token cache is built, then switch it off again. conf/env sets TOKENIZERS_PARALLELISM=false for the run
    because a process forked after the pool was used could deadlock in it; the build happens in prepare_data /
    setup, before any DataLoader worker is forked, and the variable is back to "false" (set, so the fork
    handler of `tokenizers` keeps quiet and the children do not use the pool) before this returns."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        os.environ["TOKENIZERS_PARALLELISM"] = before if before is not None else "false"


def load_hf_tokenizer(name_or_path: str):
    """AutoTokenizer, or GPT2TokenizerFast for a dir holding only vocab.json + merges.txt."""
    from transformers import AutoTokenizer, GPT2TokenizerFast

    local = Path(name_or_path).expanduser()
    if name_or_path.startswith(("/", ".", "~")) and not local.is_dir():  # a path, not a hub name
        raise PathNotFound(
            f"data.tokenizer={name_or_path!r} is not an existing dir (data.tokenizer follows "
            "model.pretrained unless set). Pass a dir with tokenizer.json (or vocab.json + merges.txt), "
            "or data.tokenizer=bytes."
        )
    if local.is_dir() and not (local / "tokenizer.json").exists() and (local / "merges.txt").exists():
        return GPT2TokenizerFast.from_pretrained(str(local))
    try:
        tok = AutoTokenizer.from_pretrained(str(local) if local.exists() else name_or_path)
    except Exception as e:  # noqa: BLE001  (OSError, ValueError, a JSON error in a damaged tokenizer.json, ...)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(
            f"data.tokenizer={name_or_path!r} could not be loaded ({first}). "
            "Pass a local dir with tokenizer.json (or vocab.json + merges.txt), e.g. "
            "data.tokenizer=/path/to/gpt2-tokenizer, or a hub name such as data.tokenizer=gpt2 when online, "
            "or the offline default data.tokenizer=bytes."
        ) from e
    # A bare tokenizer.json (no tokenizer_config.json) does not declare GPT-2's EOS; its vocab still has it.
    if tok.eos_token is None and "<|endoftext|>" in tok.get_vocab():
        tok.eos_token = "<|endoftext|>"
    return tok


def load_tokenizer(name: str, special_tokens: Sequence[str] = ()) -> Tokenizer:
    if name == "bytes":
        if special_tokens:
            raise ConfigError(
                "data.special_tokens needs a Hugging Face tokenizer; the byte tokenizer has no vocabulary to extend."
            )
        return ByteTokenizer()
    return HFTokenizer(name, special_tokens)
