"""Where documents come from: the embedded default, user files (.txt / .jsonl), or a HF dataset.

Every source is read twice at most: once to fingerprint it (cheap: file bytes, no parsing)
and, only when the token cache misses, once to parse and tokenize it.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from src.utils.errors import UserError

SUFFIXES = (".txt", ".jsonl")


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
    return CorpusError(f"{file}: {where} is {kind}. data.path takes UTF-8 text: convert the file "
                       "(e.g. iconv -f latin1 -t utf-8) or move it out of data.path.")


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


def read_documents(file: Path, text_field: str = "text") -> Iterator[str]:
    """A .txt file is one document; a .jsonl file is one document per line."""
    if file.suffix != ".jsonl":
        yield utf8_text(file)
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
        yield record[text_field]


@dataclass
class Corpus:
    """A list of files or a HF dataset, with a fingerprint of its exact content."""

    files: list[Path]
    text_field: str = "text"
    hf_dataset: Optional[object] = None
    description: str = ""

    @classmethod
    def from_config(
        cls, path: Optional[str], hf_dataset: Optional[str], hf_split: str, text_field: str
    ) -> "Corpus":
        if path and hf_dataset:
            raise CorpusError("Set either data.path or data.hf_dataset, not both.")
        if hf_dataset:
            return cls(files=[], text_field=text_field, hf_dataset=_load_hf(hf_dataset, hf_split, text_field),
                       description=f"hf:{hf_dataset}[{hf_split}]")
        if path:
            return cls(find_files(path), text_field, description=str(path))
        return cls(stdlib_files(), text_field, description="python-stdlib (embedded default)")

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        if self.hf_dataset is not None:
            h.update(self.hf_dataset._fingerprint.encode())
        for f in self.files:
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        h.update(self.text_field.encode())
        return h.hexdigest()

    def documents(self) -> Iterator[str]:
        if self.hf_dataset is not None:
            yield from self.hf_dataset[self.text_field]
            return
        for f in self.files:
            yield from read_documents(f, self.text_field)


def _load_hf(name: str, split: str, text_field: str):
    try:
        import datasets
    except ImportError as e:
        raise CorpusError("data.hf_dataset needs the `datasets` package: pip install -e '.[hf]'") from e
    ds = datasets.load_dataset(name, split=split)
    if text_field not in ds.column_names:
        raise CorpusError(f"HF dataset {name!r} has no column {text_field!r}; columns: {ds.column_names}. "
                          "Set data.text_field.")
    return ds
