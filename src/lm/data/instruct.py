"""Instruction tuning data: Alpaca-style records {instruction, input, output} from JSON or JSONL.

Each record becomes prompt + response + EOS. Labels (already shifted: labels[t] is the token after
input t) are -100 where that token is the prompt's, so the loss (and the gradient) comes from the
response and its EOS only. Records are tokenized once, at setup, and batches are padded to their longest
record with an attention mask; or, with `data.packing=true`, several records share a row, attention and
positions restarting at each (src/lm/data/packing.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from src.lm.data.corpus import CorpusError, hf_records, utf8_lines, utf8_text
from src.lm.data.packing import PackedRows, packed_collate
from src.lm.data.records import Items, RecordsDataModule, label_targets, padded_records
from src.lm.data.text import IGNORE_INDEX
from src.lm.data.tokenizers import Tokenizer
from src.utils.config import ConfigError

log = logging.getLogger(__name__)

ALPACA = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes "
    "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)
FIELDS = ("instruction", "input", "output")


def read_json_records(path: str, kind: str, hf_split: str = "train") -> list:
    """A JSON array of records, or JSONL with one record per line; errors name the line. `kind` names the format
    expected, for the error of a missing file. `hf:<name>` is a Hugging Face dataset's `hf_split` instead."""
    if path.startswith("hf:"):
        return hf_records(path[3:], hf_split)
    file = Path(path).expanduser()
    if not file.is_file():
        raise CorpusError(f"data.path={path!r} does not exist. Point it at {kind} .json or .jsonl file.")
    if file.suffix == ".jsonl":
        records = []
        for lineno, line in enumerate(utf8_lines(file), start=1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise CorpusError(f"{file}:{lineno}: malformed JSON ({e.msg}).") from e
        return records
    try:
        records = json.loads(utf8_text(file))
    except json.JSONDecodeError as e:
        raise CorpusError(f"{file}:{e.lineno}: malformed JSON ({e.msg}).") from e
    if not isinstance(records, list):
        raise CorpusError(f"{file}: expected a JSON array of records, got {type(records).__name__}.")
    return records


def read_records(path: str, hf_split: str = "train") -> list[dict]:
    """Alpaca records; errors name the record (or line)."""
    records = read_json_records(path, "an Alpaca-style", hf_split)
    for i, record in enumerate(records):
        bad = [
            k for k in ("instruction", "output") if not isinstance(record, dict) or not isinstance(record.get(k), str)
        ]
        if bad or not isinstance(record.get("input", ""), str):
            raise CorpusError(
                f"{Path(path).expanduser()}: record {i} needs string fields 'instruction' and 'output' "
                f"(and optional 'input'); got {record!r:.200}"
            )
    return records


def encode(
    records: list[dict], tokenizer: Tokenizer, template: str, template_no_input: str
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, labels) of each record's prompt + response + EOS, labels already shifted as all data here:
    labels[t] is the token after input_ids[t], -100 while that token is still the prompt's. So the
    response and its EOS are the targets, and the EOS, which predicts nothing, is not an input.
    All texts go to the tokenizer in one call: a call per record added a third to the encoding's time (the fast
    tokenizer's `__call__` overhead, paid per record on every rank at startup)."""
    prompts = [
        (template if record.get("input") else template_no_input).format(**{k: record.get(k, "") for k in FIELDS})
        for record in records
    ]
    texts = [text for prompt, record in zip(prompts, records) for text in (prompt, record["output"])]
    encoded, out = tokenizer.encode_batch(texts), []
    for prompt_ids, response_ids in zip(encoded[0::2], encoded[1::2]):
        tokens = np.concatenate([prompt_ids, response_ids, [tokenizer.eos_id]]).astype(np.int64)
        ids, labels = tokens[:-1], tokens[1:].copy()
        labels[: max(len(prompt_ids) - 1, 0)] = IGNORE_INDEX
        out.append((ids, labels))
    return out


def pad_collate(pad_id: int):
    def collate(batch: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
        return padded_records(batch, pad_id)

    return collate


class InstructDataModule(RecordsDataModule):
    def __init__(
        self,
        path: str,
        seq_len: int = 512,
        template: str = ALPACA,
        template_no_input: str = ALPACA_NO_INPUT,
        overlong: str = "truncate",
        packing: bool = False,
        **shared: Any,
    ) -> None:
        super().__init__(path, seq_len=seq_len, **shared)
        if overlong not in ("truncate", "drop"):
            raise ConfigError(f"data.overlong={overlong!r}: use truncate or drop.")
        self.template, self.template_no_input, self.overlong = template, template_no_input, overlong
        self.packing = packing

    def records(self) -> list[dict]:
        return read_records(self.path, self.hf_split)

    def build_splits(self) -> dict[str, Dataset]:
        items, dropped, truncated = [], 0, 0
        for ids, labels in encode(self.records(), self.tokenizer, self.template, self.template_no_input):
            if len(ids) > self.seq_len:
                # truncate: keep the first seq_len tokens (the response is cut, its EOS lost); drop: skip it
                if self.overlong == "drop" or (labels[: self.seq_len] == IGNORE_INDEX).all():
                    dropped += 1  # a prompt that fills the whole window leaves nothing to learn
                    continue
                ids, labels, truncated = ids[: self.seq_len], labels[: self.seq_len], truncated + 1
            items.append((ids, labels))
        if not items:
            raise CorpusError(f"No record of {self.path} fits data.seq_len={self.seq_len}.")
        parts = self.cut_splits(items, "record")
        log.info(
            f"{len(items)} records ({truncated} truncated, {dropped} dropped at seq_len {self.seq_len}) -> "
            f"{'/'.join(str(len(part)) for part in parts.values())} train/val/test"
        )
        if self.packing:
            return {name: PackedRows(part, self.seq_len) for name, part in parts.items()}
        return {name: Items(part, label_targets(part)) for name, part in parts.items()}

    def collate_fn(self):
        return packed_collate(self.tokenizer.eos_id) if self.packing else pad_collate(self.tokenizer.eos_id)
