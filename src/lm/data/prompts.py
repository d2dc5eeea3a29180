"""Prompts for online RL (`data=prompts`, `model/objective=grpo`): a .json array or .jsonl of records, each with a
`prompt` (plain text, used as it is, or chat messages `[{"role", "content"}]` / ShareGPT turns, rendered with the
tokenizer's chat template when it has one, else `data.template`) and any other fields (a reference `answer`, ...),
which the reward functions receive by name, as TRL's GRPOTrainer passes a dataset's columns.

A batch holds prompts, not targets: the objective samples the completions. An item is (the prompt's number in the
file, its token ids); prompts longer than `data.max_prompt_len` lose their start. Each prompt counts one in the
optimizer step's normaliser (LitModule.token_mean_loss), so the loss is a mean over the step's prompts on any
number of ranks.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from src.lm.data.corpus import CorpusError
from src.lm.data.instruct import ALPACA_NO_INPUT, read_json_records
from src.lm.data.preference import Message, Renderer, message
from src.lm.data.records import Items, RecordsDataModule, right_padded
from src.utils.config import check_prompt_len

log = logging.getLogger(__name__)


def parse(record: Any, where: str) -> tuple[list[Message] | str, dict[str, Any]]:
    """(the prompt: messages or plain text, the record's other fields)."""
    if not isinstance(record, dict) or "prompt" not in record:
        raise CorpusError(
            f"{where} has no 'prompt': every record needs one (text, or chat messages [{{'role', 'content'}}])."
        )
    prompt = record["prompt"]
    if isinstance(prompt, list):
        prompt = [message(turn, where) for turn in prompt]
    elif not isinstance(prompt, str):
        raise CorpusError(f"{where}: 'prompt' is a {type(prompt).__name__}, not text or a list of messages.")
    return prompt, {k: v for k, v in record.items() if k != "prompt"}


def prompt_collate(pad_id: int):
    """The prompts right-padded to the longest, with their lengths and numbers (-1: evaluation's padding item)."""

    def collate(batch: list[tuple[int, np.ndarray]]) -> dict[str, torch.Tensor]:
        return {
            "prompt_ids": right_padded([prompt for _, prompt in batch], pad_id),
            "prompt_lengths": torch.tensor([len(p) for _, p in batch], dtype=torch.long),
            "prompt_index": torch.tensor([i for i, _ in batch], dtype=torch.long),
        }

    return collate


class PromptDataModule(RecordsDataModule):
    batch_kind = "prompts"

    def __init__(
        self,
        path: str,
        seq_len: int = 256,
        max_prompt_len: Optional[int] = None,
        template: str = ALPACA_NO_INPUT,
        **shared: Any,
    ) -> None:
        super().__init__(path, seq_len=seq_len, **shared)
        self.max_prompt_len = check_prompt_len(seq_len, max_prompt_len, "completions")
        self.template = template
        self.texts: list[str] = []  # each prompt as the model reads it, by its number
        self.columns: list[dict[str, Any]] = []  # each record's other fields, by its number

    def records(self) -> list[tuple]:
        where = f"{self.path}: record"
        return [parse(r, f"{where} {i}") for i, r in enumerate(read_json_records(self.path, "a prompt", self.hf_split))]

    def build_splits(self) -> dict[str, Dataset]:
        render = Renderer(self.tokenizer, self.template)
        records = self.records()
        if not records:
            raise CorpusError(f"{self.path} holds no prompts.")
        self.texts = [render(prompt, "")[0] for prompt, _ in records]
        self.columns = [columns for _, columns in records]
        encoded = self.tokenizer.encode_batch(self.texts)
        cut = sum(len(ids) > self.max_prompt_len for ids in encoded)
        items = [(i, ids[-self.max_prompt_len :].astype(np.int64)) for i, ids in enumerate(encoded)]
        parts = self.cut_splits(items, "prompt")
        log.info(
            f"{len(items)} prompts, {cut} cut from the left to data.max_prompt_len={self.max_prompt_len} -> "
            f"{'/'.join(str(len(part)) for part in parts.values())} train/val/test"
        )
        return {name: Items(part) for name, part in parts.items()}  # item: (the prompt's number, its ids); one target

    def padding_sample(self, sample: tuple) -> tuple:
        """Evaluation padding: a real prompt numbered -1, which the objective counts nowhere."""
        return (-1, sample[1])

    def collate_fn(self):
        return prompt_collate(self.tokenizer.eos_id)
