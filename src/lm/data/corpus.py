"""Where documents come from: the embedded default, user files (.txt / .jsonl), or a HF dataset.

A file is read at most twice: once to hash it, the first time it is seen (file_hashes.py: later
starts only stat it), and, only when the token cache misses, once to parse and tokenize it. Both
reads stream, so memory does not grow with the corpus or its largest file: a .jsonl file is read a
line at a time, a HF dataset a batch at a time, and a .txt file (one document) in pieces of about
`txt_chunk_chars` characters cut where the text goes from a non-space character into whitespace,
preferably a blank line. The cut keeps the token stream exact: byte tokens trivially, and for
byte-level BPE (GPT-2's family) because its pre-tokenizer never joins a non-space character with
the whitespace after it, and the whole whitespace run goes to the next piece with what follows it.
Only text with no whitespace for 2 x txt_chunk_chars characters is cut mid-word.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from src.lm.data.file_hashes import FileHashes
from src.utils.errors import UserError

SUFFIXES = (".txt", ".jsonl")
TXT_CHUNK_CHARS = 1 << 18  # default piece of a .txt file per tokenizer input (data.txt_chunk_chars)
HF_BATCH = 1000  # records per batch read from a HF dataset
_LAST_SPACE_RUN = re.compile(r"\s\S")  # searched in the reversed text: the last non-space -> space boundary


class CorpusError(UserError, ValueError):
    """Bad input data; the message names the file (and line) and what to do."""


def stdlib_files() -> list[Path]:
    """The embedded default corpus: the Python standard library's own top-level sources.

    Real text (code, docstrings, comments) that every Python install carries, so the
    default run needs no download and nobody here wrote it. About 4.7 MB on CPython 3.11.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise CorpusError(f"No .py files found in the standard library dir {root}; pass data.path=FILE_OR_DIR.")
    return files


def find_files(path: str) -> list[Path]:
    p = Path(path).expanduser()
    if not p.exists():
        raise CorpusError(f"data.path={path!r} does not exist. Pass an existing .txt/.jsonl file or a dir of them.")
    if p.is_file():
        if p.suffix not in SUFFIXES:
            raise CorpusError(f"data.path={path!r}: unsupported file type {p.suffix!r}; use .txt or .jsonl.")
        return [p]
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES)
    if not files:
        raise CorpusError(f"data.path={path!r} is a dir with no .txt or .jsonl files in it.")
    return files


def _not_text(file: Path, where: str, data: bytes, e: UnicodeDecodeError) -> CorpusError:
    kind = "binary data (NUL bytes)" if b"\0" in data else f"not UTF-8 text (byte 0x{data[e.start]:02x})"
    return CorpusError(
        f"{file}: {where} is {kind}. data.path takes UTF-8 text: convert the file "
        "(e.g. iconv -f latin1 -t utf-8) or move it out of data.path."
    )


def utf8_text(file: Path) -> str:
    """The file as text; a binary or non-UTF-8 file is refused with its byte offset, never silently replaced."""
    data = file.read_bytes()
    try:
        if b"\0" in data:
            raise UnicodeDecodeError("utf-8", data, data.index(b"\0"), data.index(b"\0") + 1, "NUL byte")
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_text(file, f"byte {e.start}", data, e) from None


def utf8_lines(file: Path) -> Iterator[str]:
    """The file's lines as text; a line that is not UTF-8 is refused with its line number."""
    with file.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _not_text(file, f"line {lineno} (byte {e.start} of the line)", raw, e) from None


def cut_point(text: str, target: int) -> int:
    """Where to end a piece of `text` (> 0, or 0 for "not yet"): before the last whitespace run that follows
    a non-space character, preferably one holding a blank line; a hard cut only if there is no whitespace."""
    blank = text.rfind("\n\n")
    while blank > 0 and text[blank - 1].isspace():
        blank -= 1
    if blank > target // 2:  # a paragraph boundary, not too early in the window
        return blank
    m = _LAST_SPACE_RUN.search(text[::-1])
    if m:
        return len(text) - 1 - m.start()
    return 0 if text.isspace() else target  # whitespace only: wait for text (no cut is exact there)


def txt_pieces(file: Path, chunk_chars: int = TXT_CHUNK_CHARS) -> Iterator[tuple[str, bool]]:
    """A .txt file as one document, streamed: (piece, is_last) pairs whose concatenation is the file."""
    decoder, buf, offset = codecs.getincrementaldecoder("utf-8")("strict"), "", 0
    with file.open("rb") as f:
        while True:
            raw = f.read(chunk_chars)
            if b"\0" in raw:
                at = raw.index(b"\0")
                raise _not_text(file, f"byte {offset + at}", raw, UnicodeDecodeError("utf-8", raw, at, at + 1, "NUL"))
            pending = len(decoder.getstate()[0])
            try:
                buf += decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise _not_text(file, f"byte {offset - pending + e.start}", e.object, e) from None
            offset += len(raw)
            while len(buf) >= 2 * chunk_chars and (cut := cut_point(buf[: 2 * chunk_chars], chunk_chars)):
                yield buf[:cut], False
                buf = buf[cut:]
            if not raw:
                yield buf, True
                return


def read_pieces(file: Path, text_field: str = "text", chunk_chars: int = TXT_CHUNK_CHARS) -> Iterator[tuple[str, bool]]:
    """(text, ends_document): a .txt file is one document in pieces; a .jsonl file one document per line."""
    if file.suffix != ".jsonl":
        yield from txt_pieces(file, chunk_chars)
        return
    for lineno, line in enumerate(utf8_lines(file), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(
                f"{file}:{lineno}: malformed JSON ({e.msg} at column {e.colno}). "
                f'Each line must be one JSON object such as {{"{text_field}": "..."}}.'
            ) from e
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise CorpusError(
                f"{file}:{lineno}: expected a JSON object with a string field {text_field!r}, "
                f"got {type(record).__name__} with keys {list(record)[:5] if isinstance(record, dict) else '-'}. "
                "Set data.text_field to the field that holds the text."
            )
        yield record[text_field], True


@dataclass
class Corpus:
    """A list of files or a HF dataset, with a fingerprint of its exact content."""

    files: list[Path]
    text_field: str = "text"
    hf_dataset: Optional[object] = None
    description: str = ""
    txt_chunk_chars: int = TXT_CHUNK_CHARS
    file_hashes: Optional[FileHashes] = None  # set by fingerprint(); saved once the cache exists

    @classmethod
    def from_config(
        cls,
        path: Optional[str],
        hf_dataset: Optional[str],
        hf_split: str,
        text_field: str,
        hf_streaming: bool = False,
        txt_chunk_chars: int = TXT_CHUNK_CHARS,
    ) -> "Corpus":
        if path and hf_dataset:
            raise CorpusError("Set either data.path or data.hf_dataset, not both.")
        if hf_dataset:
            return cls(
                files=[],
                text_field=text_field,
                hf_dataset=_load_hf(hf_dataset, hf_split, text_field, hf_streaming),
                description=f"hf:{hf_dataset}[{hf_split}]" + (" (streaming)" if hf_streaming else ""),
            )
        if path:
            return cls(find_files(path), text_field, description=str(path), txt_chunk_chars=txt_chunk_chars)
        return cls(
            stdlib_files(), text_field, description="python-stdlib (embedded default)", txt_chunk_chars=txt_chunk_chars
        )

    def fingerprint(self, index_dir: Optional[Path] = None) -> str:
        """Hash of the content; with `index_dir`, files unchanged since they were hashed are only stat'ed."""
        h, self.file_hashes = hashlib.sha256(), FileHashes(self.files, index_dir)
        if self.hf_dataset is not None:  # a streamed dataset has no content hash: its name and split stand for it
            h.update((getattr(self.hf_dataset, "_fingerprint", None) or self.description).encode())
        for f, digest in zip(self.files, self.file_hashes.sha256s()):
            h.update(f.name.encode() + b"\0" + digest.encode() + b"\0")
        h.update(self.text_field.encode())
        return h.hexdigest()

    def pieces(self) -> Iterator[tuple[str, bool]]:
        """The corpus as (text, ends_document) pairs, streamed; a document may come in several pieces."""
        if self.hf_dataset is not None:
            for batch in self.hf_dataset.iter(batch_size=HF_BATCH):
                if self.text_field not in batch:
                    raise CorpusError(
                        f"{self.description} has no column {self.text_field!r}; columns: "
                        f"{list(batch)}. Set data.text_field."
                    )
                for text in batch[self.text_field]:
                    yield text, True
            return
        for f in self.files:
            yield from read_pieces(f, self.text_field, self.txt_chunk_chars)

    def documents(self) -> Iterator[str]:
        """Whole documents (a .txt file joined back from its pieces): for small corpora and tests."""
        parts: list[str] = []
        for text, last in self.pieces():
            parts.append(text)
            if last:
                yield "".join(parts)
                parts = []


def _datasets():
    try:
        import datasets
    except ImportError as e:
        raise CorpusError("data.hf_dataset needs the `datasets` package: pip install -e '.[hf]'") from e
    return datasets


def hf_records(name: str, split: str) -> list[dict]:
    """The rows of a Hugging Face dataset as dicts: a hub name (online, cached by `datasets`) or anything
    `datasets.load_dataset` reads, such as a local dir of .parquet / .jsonl files."""
    datasets = _datasets()
    try:
        return datasets.load_dataset(name, split=split).to_list()
    except Exception as e:  # noqa: BLE001 - no network, no such dataset or split: one sentence naming it
        raise CorpusError(
            f"The Hugging Face dataset {name!r} (split {split!r}) could not be loaded ({type(e).__name__}: "
            f"{str(e)[:200]}): check its name, data.hf_split and the network, or give a local file."
        ) from None


def _load_hf(name: str, split: str, text_field: str, streaming: bool = False):
    datasets = _datasets()
    ds = (
        datasets.load_dataset(name, split=split, streaming=True)
        if streaming
        else datasets.load_dataset(name, split=split)
    )
    if ds.column_names is not None and text_field not in ds.column_names:  # a stream may not know them yet
        raise CorpusError(
            f"HF dataset {name!r} has no column {text_field!r}; columns: {ds.column_names}. Set data.text_field."
        )
    return ds
