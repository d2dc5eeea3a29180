"""Preference pairs for DPO (`data=preference`, `model/objective=dpo`): a prompt, a chosen and a rejected answer,
from a .json array or .jsonl, in any of three formats:

- ShareGPT pairwise (LLaMA-Factory's dpo_*_demo.json): {"conversations": [{"from": "system"|"human"|"gpt", "value"}],
  "chosen": {"from": "gpt", "value"}, "rejected": {...}}; every turn of `conversations` is the prompt;
- plain: {"prompt": str, "chosen": str, "rejected": str}; the prompt text is used as it is;
- chat: {"prompt" (or "messages"): [{"role", "content"}, ...], "chosen": str | message | [message], "rejected": ...}.

A conversation is rendered with the tokenizer's chat template when it has one, else with `template` (the instruct
data's Alpaca template: its {instruction} is the single user turn, or the turns as "role: text" paragraphs).

Each pair becomes two sequences, prompt + chosen + EOS and prompt + rejected + EOS, labels shifted and -100 over
the prompt, as in data=instruct. A batch of B pairs is 2B rows, the B chosen and then the B rejected, so a pair's two
answers always go through one forward on one rank. A pair longer than seq_len has its prompt cut from the left
(down to max_prompt_len tokens at least), then its answers from the right; or is dropped (overlong=drop).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from src.lm.data.corpus import CorpusError
from src.lm.data.instruct import ALPACA_NO_INPUT, read_json_records
from src.lm.data.records import Items, RecordsDataModule, padded_records
from src.lm.data.text import IGNORE_INDEX
from src.lm.data.tokenizers import Tokenizer
from src.utils.config import ConfigError, check_prompt_len

log = logging.getLogger(__name__)

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
Message = dict[str, str]


def message(turn: Any, where: str) -> Message:
    """{"role", "content"} from a ShareGPT turn ({"from", "value"}) or a chat message."""
    if isinstance(turn, dict):
        role, text = turn.get("role", turn.get("from")), turn.get("content", turn.get("value"))
        if role in ROLES and isinstance(text, str):
            return {"role": ROLES[role], "content": text}
    raise CorpusError(
        f"{where}: {turn!r:.120} is not a turn ({{'from': 'human'|'gpt'|'system', 'value': str}} or "
        "{'role': ..., 'content': str})."
    )


def answer_text(value: Any, where: str) -> str:
    """An answer given as a string, a message, or a list holding one assistant message."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    return value if isinstance(value, str) else message(value, where)["content"]


def parse(record: Any, where: str) -> tuple[list[Message] | str, str, str, Optional[float]]:
    """(prompt: messages or plain text, chosen, rejected, margin or None) of one record in any of the three formats;
    `margin`: how much the chosen answer is preferred (TRL's column), for a reward model's loss."""
    if not isinstance(record, dict):
        raise CorpusError(f"{where} is a {type(record).__name__}, not a record with 'chosen' and 'rejected'.")
    missing = [k for k in ("chosen", "rejected") if k not in record]
    if missing:
        raise CorpusError(
            f"{where} has no {' or '.join(repr(k) for k in missing)} answer: every record needs a "
            "'chosen' and a 'rejected' answer (see conf/data/preference.yaml for the formats)."
        )
    prompt = record.get("conversations", record.get("messages", record.get("prompt")))
    if isinstance(prompt, list):
        prompt = [message(turn, where) for turn in prompt]
    elif not isinstance(prompt, str):
        raise CorpusError(
            f"{where} has no prompt: give 'conversations' (ShareGPT), 'prompt' (text or messages) or 'messages'."
        )
    margin = record.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))):
        raise CorpusError(f"{where}: 'margin' is {margin!r}, not a number.")
    return (
        prompt,
        answer_text(record["chosen"], f"{where} 'chosen'"),
        answer_text(record["rejected"], f"{where} 'rejected'"),
        None if margin is None else float(margin),
    )


class Renderer:
    """Prompt and answer texts: the tokenizer's chat template when it has one, else the instruct template."""

    def __init__(self, tokenizer: Tokenizer, template: str) -> None:
        hf = getattr(tokenizer, "hf", None)
        self.chat = hf if getattr(hf, "chat_template", None) else None
        self.template = template

    def __call__(self, prompt: list[Message] | str, answer: str) -> tuple[str, str]:
        if isinstance(prompt, str):
            return prompt, answer
        if self.chat is not None:  # the answer is what the template adds after the generation prompt
            head = self.chat.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            whole = self.chat.apply_chat_template([*prompt, {"role": "assistant", "content": answer}], tokenize=False)
            if whole.startswith(head):
                return head, whole[len(head) :]
            return head, answer
        if len(prompt) == 1 and prompt[0]["role"] == "user":
            return self.template.format(instruction=prompt[0]["content"]), answer
        return self.template.format(instruction="\n\n".join(f"{m['role']}: {m['content']}" for m in prompt)), answer


def sequence(prompt: np.ndarray, answer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) of prompt + answer, labels shifted and -100 while the target is a prompt token."""
    tokens = np.concatenate([prompt, answer]).astype(np.int64)
    ids, labels = tokens[:-1], tokens[1:].copy()
    labels[: max(len(prompt) - 1, 0)] = IGNORE_INDEX
    return ids, labels


def pair_collate(pad_id: int, margins: Optional[np.ndarray] = None):
    """2B rows right-padded to the longest of the batch: the B chosen sequences, then the B rejected ones; with
    `margins` (one per pair, by its number), the batch's pairs' margins too."""

    def collate(batch: list[tuple]) -> dict[str, torch.Tensor]:
        rows = [(item[1], item[2]) for item in batch] + [(item[3], item[4]) for item in batch]
        index = torch.tensor([item[0] for item in batch], dtype=torch.long)
        out = {**padded_records(rows, pad_id), "pair_index": index}
        if margins is not None:
            out["margin"] = torch.from_numpy(margins[index.numpy()])
        return out

    return collate


class PreferenceDataModule(RecordsDataModule):
    batch_kind = "pairs"

    def __init__(
        self,
        path: str,
        seq_len: int = 512,
        max_prompt_len: Optional[int] = None,
        template: str = ALPACA_NO_INPUT,
        overlong: str = "truncate",
        **shared: Any,
    ) -> None:
        super().__init__(path, seq_len=seq_len, **shared)
        self.max_prompt_len = check_prompt_len(seq_len, max_prompt_len, "the answers")
        if overlong not in ("truncate", "drop"):
            raise ConfigError(f"data.overlong={overlong!r}: use truncate or drop.")
        self.template, self.overlong = template, overlong
        self.counts: dict[str, int] = {}
        self.margins: Optional[np.ndarray] = None  # each usable pair's margin, by its number, when the records have one

    def records(self) -> list[tuple]:
        where = f"{self.path}: record"
        return [
            parse(r, f"{where} {i}") for i, r in enumerate(read_json_records(self.path, "a preference", self.hf_split))
        ]

    def cut(self, prompt: np.ndarray, chosen: np.ndarray, rejected: np.ndarray) -> Optional[tuple]:
        """The pair cut to seq_len (prompt from the left, then the answers from the right), or None to drop it."""
        room = self.seq_len + 1  # tokens: the last one is a target only
        longest = max(len(chosen), len(rejected))
        if len(prompt) + longest <= room:
            return prompt, chosen, rejected
        if self.overlong == "drop":
            return None
        keep = min(len(prompt), max(room - longest, self.max_prompt_len))
        self.counts["prompt_cut"] += keep < len(prompt)
        self.counts["answer_cut"] += keep + longest > room
        prompt = prompt[len(prompt) - keep :]
        return prompt, chosen[: room - keep], rejected[: room - keep]

    def build_splits(self) -> dict[str, Dataset]:
        self.counts = {"pairs": 0, "prompt_cut": 0, "answer_cut": 0, "dropped": 0, "identical": 0}
        render, tok, items = Renderer(self.tokenizer, self.template), self.tokenizer, []
        eos = np.array([tok.eos_id])
        records = self.records()
        with_margin = sum(r[3] is not None for r in records)
        if 0 < with_margin < len(records):
            raise CorpusError(
                f"{self.path}: {with_margin} of {len(records)} records have a 'margin': give every record one, or none."
            )
        texts = []  # every pair's (prompt, chosen, rejected) texts, encoded in one call (as instruct.encode)
        for prompt, chosen, rejected, _ in records:
            self.counts["pairs"] += 1
            self.counts["identical"] += chosen == rejected
            (head, chosen), (_, rejected) = render(prompt, chosen), render(prompt, rejected)
            texts += [head, chosen, rejected]
        encoded, margins = tok.encode_batch(texts), []
        for (*_, margin), p, c, r in zip(records, encoded[0::3], encoded[1::3], encoded[2::3]):
            fitted = self.cut(p, np.concatenate([c, eos]), np.concatenate([r, eos]))
            if fitted is None:
                self.counts["dropped"] += 1
                continue
            items.append((len(items), *sequence(fitted[0], fitted[1]), *sequence(fitted[0], fitted[2])))
            margins.append(margin)
        self.margins = np.array(margins, dtype=np.float32) if with_margin else None
        if self.counts["identical"]:
            log.warning(
                f"{self.path}: {self.counts['identical']} pair(s) have the same chosen and rejected answer; "
                "they teach nothing (their DPO gradient is zero)"
            )
        if not items:
            raise CorpusError(
                f"No pair of {self.path} fits data.seq_len={self.seq_len}: raise it or use data.overlong=truncate."
            )
        parts, c = self.cut_splits(items, "pair"), self.counts
        log.info(
            f"{c['pairs']} pairs: {c['prompt_cut']} prompts cut from the left, {c['answer_cut']} answers cut, "
            f"{c['dropped']} dropped at seq_len {self.seq_len} -> "
            f"{'/'.join(str(len(part)) for part in parts.values())} train/val/test"
        )
        # item: (the pair's number among the file's usable pairs, so that a precomputed reference log-prob is found
        # again (src/lm/objectives/dpo.py), chosen ids, chosen labels, rejected ids, rejected labels); one target each
        return {name: Items(part) for name, part in parts.items()}

    def padding_sample(self, sample: tuple) -> tuple:
        """Evaluation padding: the pair's inputs, no targets (so it counts in no metric)."""
        index, c_ids, c_labels, r_ids, r_labels = sample
        return (index, c_ids, np.full_like(c_labels, IGNORE_INDEX), r_ids, np.full_like(r_labels, IGNORE_INDEX))

    def collate_fn(self):
        return pair_collate(self.tokenizer.eos_id, self.margins)
