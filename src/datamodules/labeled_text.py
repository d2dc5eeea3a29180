"""Short texts with a class each, for a sequence classifier: a JSONL or CSV file of {text, label} at `path`, or,
offline with no file, the docstrings of a few standard-library packages labelled by the package they come from.

Each text is tokenized once (src/lm/data/tokenizers.py: UTF-8 bytes by default, or a Hugging Face tokenizer
dir) as a classifier reads it: within the tokenizer's own special tokens (BERT's [CLS] ... [SEP]), or, for one that
adds none (GPT-2's, the bytes), after its EOS, the token in [CLS]'s place that the head reads; a batch is padded to
its longest text, with an attention mask. The labels are the sorted label names, their ids the positions:
the model gets them (`model_kwargs`) and its export writes them as id2label.
"""

from __future__ import annotations

import ast
import csv
import json
import logging
import re
import sysconfig
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from src.core.datamodule import ShardedDataModule
from src.lm.data.tokenizers import ByteTokenizer, load_hf_tokenizer
from src.utils.config import ConfigError, check_int
from src.utils.errors import PathNotFound

log = logging.getLogger(__name__)


def docstrings(packages: list[str]) -> tuple[list[str], list[str]]:
    """(texts, labels): the first paragraph of every module, class and function docstring of each standard-library
    package (its tests left out), one line each, labelled by the package; a text found in two packages is dropped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: dict[str, set[str]] = {}
    for package in packages:
        if not (root / package).is_dir():
            raise ConfigError(f"data.packages: {package!r} is no package of the standard library at {root}.")
        for file in sorted((root / package).rglob("*.py")):
            if any(part.startswith("test") for part in file.relative_to(root).parts):
                continue
            with warnings.catch_warnings():  # Python 3.12+ warns of the stdlib's own invalid escapes as it parses
                warnings.simplefilter("ignore", SyntaxWarning)
                tree = ast.parse(file.read_text(encoding="utf-8-sig", errors="replace"))
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    text = re.sub(r"\s+", " ", doc.split("\n\n")[0]).strip() if doc else ""
                    if len(text) >= 16:
                        found.setdefault(text, set()).add(package)
    pairs = sorted((text, next(iter(labels))) for text, labels in found.items() if len(labels) == 1)
    return [t for t, _ in pairs], [label for _, label in pairs]


def read_file(path: str, text_field: str, label_field: str) -> tuple[list[str], list[str]]:
    """(texts, labels) from a .jsonl of objects or a .csv with a header row."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise PathNotFound(f"data.path={path!r} is not a file: pass a .jsonl or .csv of {text_field}, {label_field}.")
    if file.suffix == ".csv":
        with file.open(newline="") as f:
            rows = list(csv.DictReader(f))
    elif file.suffix == ".jsonl":
        rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    else:
        raise ConfigError(f"data.path={path!r}: use a .jsonl or .csv file of {text_field}, {label_field}.")
    missing = [i for i, row in enumerate(rows) if text_field not in row or label_field not in row]
    if missing:
        raise ConfigError(
            f"data.path={path!r}: record {missing[0] + 1} lacks {text_field!r} or {label_field!r}: set "
            "data.text_field and data.label_field to its keys."
        )
    return [str(row[text_field]) for row in rows], [str(row[label_field]) for row in rows]


class ClassifierTokenizer:
    """`name`'s tokenizer ("bytes" or a Hugging Face dir) encoding texts as a classifier reads them (module doc); `hf`
    the Hugging Face tokenizer export-hf saves beside the model (None for bytes)."""

    def __init__(self, name: str) -> None:
        self.hf = None if name == "bytes" else load_hf_tokenizer(name)
        if self.hf is None:
            self.vocab_size, self.pad_id, self.start = ByteTokenizer.vocab_size, 0, [ByteTokenizer.eos_id]
            return
        self.vocab_size = len(self.hf)
        self.pad_id = self.hf.pad_token_id if self.hf.pad_token_id is not None else 0
        self.start = None if self.hf("a")["input_ids"] != self.hf("a", add_special_tokens=False)["input_ids"] else []
        if self.start == [] and self.hf.eos_token_id is None:
            raise ConfigError(
                f"data.tokenizer={name!r} adds no special tokens and has no EOS to start each text with: use a "
                "tokenizer with either (BERT's, GPT-2's) or data.tokenizer=bytes."
            )
        if self.start == []:
            self.start = [self.hf.eos_token_id]

    def encode(self, texts: list[str], max_tokens: int) -> list[np.ndarray]:
        """Each text's ids, at most `max_tokens` with the special tokens."""
        if self.start is None:  # the tokenizer's own template, cut to max_tokens with its closing token kept
            ids = self.hf(texts, truncation=True, max_length=max_tokens)["input_ids"]
        elif self.hf is None:
            ids = [list(t.encode("utf-8")) for t in texts]
        else:
            ids = self.hf(texts, add_special_tokens=False)["input_ids"]
        if self.start is not None:
            ids = [self.start + list(x[: max_tokens - len(self.start)]) for x in ids]
        return [np.asarray(x, dtype=np.int64) for x in ids]


class Encoded(Dataset):
    """Item i: {"input_ids": the i-th text's token ids, "labels": its class id}."""

    def __init__(self, ids: list[np.ndarray], labels: np.ndarray) -> None:
        self.ids, self.labels = ids, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": torch.from_numpy(self.ids[i]), "labels": int(self.labels[i])}


class PadBatch:
    """Collate items into {"input_ids", "attention_mask", "labels"}, padded with `pad_id` to the batch's longest."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(item["input_ids"]) for item in items)
        ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, item in enumerate(items):
            ids[row, : len(item["input_ids"])] = item["input_ids"]
            mask[row, : len(item["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([i["labels"] for i in items])}


class LabeledTextDataModule(ShardedDataModule):
    """`path`: a .jsonl or .csv of records with `text_field` and `label_field`; None: the docstrings of `packages`.
    Shuffled once with a fixed seed and cut into val, test and train; each text cut to `max_tokens` tokens."""

    def __init__(
        self,
        path: Optional[str] = None,
        packages: tuple[str, ...] = ("asyncio", "email", "importlib", "logging"),
        text_field: str = "text",
        label_field: str = "label",
        tokenizer: str = "bytes",
        max_tokens: int = 128,
        val_size: int = 64,
        test_size: int = 64,
        **shared: Any,
    ) -> None:
        super().__init__(**shared)
        check_int("data.max_tokens", max_tokens)
        self.path, self.max_tokens, self.val_size, self.test_size = path, max_tokens, val_size, test_size
        if path:
            self.texts, names = read_file(path, text_field, label_field)
        else:
            self.texts, names = docstrings(list(packages))
        self.labels = sorted(set(names))
        if len(self.labels) < 2:
            raise ConfigError(f"data: {len(self.labels)} label(s) found; a classifier needs 2 or more.")
        index = {label: i for i, label in enumerate(self.labels)}
        self.label_ids = np.array([index[name] for name in names], dtype=np.int64)
        self.tokenizer = ClassifierTokenizer(tokenizer)

    @property
    def model_kwargs(self) -> dict[str, Any]:
        return {"labels": self.labels, "vocab_size": self.tokenizer.vocab_size, "pad_token_id": self.tokenizer.pad_id}

    def collate_fn(self) -> Optional[Callable]:
        return PadBatch(self.tokenizer.pad_id)

    def build_splits(self) -> dict[str, Dataset]:
        order = np.random.default_rng(0).permutation(len(self.texts))  # fixed: the splits never change
        n_eval = self.val_size + self.test_size
        if n_eval >= len(order):
            raise ConfigError(f"data.val_size + data.test_size = {n_eval} leaves no training texts of {len(order)}.")
        ids = self.tokenizer.encode([self.texts[i] for i in order], self.max_tokens)
        labels = self.label_ids[order]
        cuts = {"val": (0, self.val_size), "test": (self.val_size, n_eval), "train": (n_eval, len(order))}
        log.info(f"{len(order) - n_eval}/{self.val_size}/{self.test_size} train/val/test texts, labels {self.labels}")
        return {split: Encoded(ids[a:b], labels[a:b]) for split, (a, b) in cuts.items()}
