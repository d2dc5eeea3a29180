"""Conversations (`data=chat`): multi-turn chats with tool calls, trained on the assistant's turns only.

Records, from a .json array, .jsonl, or a dir of them, in either layout (`data.layout=auto` tells them apart):

- messages (OpenAI): {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str | [{"type": "text",
  "text": str}], "tool_calls": [{"type": "function", "function": {"name", "arguments"}}]}], "tools": [...]};
- ShareGPT: {"conversations": [{"from": "system"|"human"|"gpt"|"function_call"|"observation", "value": str}],
  "tools": JSON text or list, "system": str}; a function_call turn is the assistant calling a tool (its value the
  call's JSON), an observation the tool's result.

Rendered with the tokenizer's own chat template, or `data.chat_template` (the default `chatml` for a tokenizer
without one, GPT-2's and the byte tokenizer: ChatML's layout with the tokenizer's EOS closing every turn, so
generation stops where a turn ends; any Jinja string or a file). Tool calls and results render as the template
renders them.

Targets (`data.train_on`): `assistant` (every assistant turn's tokens and the end-of-turn token that closes it),
`last` (the final assistant turn only) or `all` (every token). What an assistant turn is, is found without
markers in the template: rendering the conversation up to turn k with the generation prompt gives the text
before the turn, rendering it up to turn k inclusive the text with it; the difference (less the whitespace the
template puts after a turn) is the turn. Each piece is tokenized on its own, as generation sees it (the prompt
tokenized, then the reply). A template that renders earlier turns differently once later turns follow (some strip
reasoning from history) is refused, naming the record.

A conversation longer than seq_len (`data.overlong`): `turns` (default) keeps its longest prefix that ends with
an assistant turn and fits, `truncate` cuts it at seq_len, `drop` skips it; the counts are logged. Conversations
without an assistant turn are counted and skipped. `data.packing=true` packs several in a row
(src/lm/data/packing.py).
"""

from __future__ import annotations

import json
import logging
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

import numpy as np
from torch.utils.data import Dataset

from src.lm.data.corpus import CorpusError
from src.lm.data.instruct import pad_collate, read_json_records
from src.lm.data.packing import PackedRows, packed_collate, padding_share
from src.lm.data.records import Items, RecordsDataModule, label_targets
from src.lm.data.text import IGNORE_INDEX
from src.lm.data.tokenizers import Tokenizer
from src.utils.config import ConfigError

log = logging.getLogger(__name__)

# ChatML's layout, each turn closed by the tokenizer's EOS; tools listed in the system turn, calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, results as the `tool` role's turns
CHATML = (
    "{% if tools or messages[0].role == 'system' %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% if tools %}{{ '\\n\\n' }}{% endif %}{% endif %}"
    "{% if tools %}You may call these tools, one JSON object each inside <tool_call></tool_call>:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>{% endif %}"
    "{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}{% if not (loop.first and message.role == 'system') %}"
    "<|im_start|>{{ message.role }}\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n{{ call.function | tojson }}\n</tool_call>{% endfor %}"
    "{{ eos_token }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
SHAREGPT = {
    **{"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"},
    **{"function_call": "assistant", "observation": "tool", "tool": "tool", "function": "tool"},
}
LAYOUTS = ("auto", "messages", "sharegpt")
TRAIN_ON = ("assistant", "last", "all")
OVERLONG = ("turns", "truncate", "drop")
EOS_MARK = "\x00eos\x00"  # the byte tokenizer's EOS in rendered text (it has no EOS text)

Message = dict[str, Any]


def text_of(content: Any, where: str) -> str:
    """A message's content: a string, or the text of a list of parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content):
        return "".join(p.get("text", "") for p in content if p.get("type", "text") == "text")
    raise CorpusError(f"{where}: content {content!r:.80} is neither text nor a list of text parts.")


def tool_list(tools: Any, where: str) -> Optional[list[dict]]:
    """A record's tools as OpenAI's function schemas (ShareGPT gives them as JSON text of bare functions)."""
    if tools in (None, "", []):
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{where}: 'tools' is not valid JSON ({e.msg}).") from e
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise CorpusError(f"{where}: 'tools' must be a list of function schemas.")
    return [t if "type" in t else {"type": "function", "function": t} for t in tools]


def tool_call(value: str) -> Message:
    """An assistant message calling a tool, from a ShareGPT function_call value ({"name", "arguments"} as JSON);
    a value that is not such JSON stays the message's text."""
    try:
        call = json.loads(value)
    except json.JSONDecodeError:
        call = None
    if isinstance(call, dict) and "name" in call:
        function = {"name": call["name"], "arguments": call.get("arguments", {})}
        return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": function}]}
    return {"role": "assistant", "content": value}


def conversation(record: Any, where: str, layout: str) -> tuple[list[Message], Optional[list[dict]]]:
    """(messages, tools) of one record in either layout."""
    if layout == "auto" and isinstance(record, dict):
        layout = "messages" if "messages" in record else "sharegpt" if "conversations" in record else "auto"
    key = {"messages": "messages", "sharegpt": "conversations"}.get(layout)
    if not isinstance(record, dict) or key is None or not isinstance(record.get(key), list):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise CorpusError(
            f"{where} has neither layout (keys: {keys}): give 'messages' ([{{'role', 'content'}}, ...]) or "
            "'conversations' (ShareGPT: [{'from', 'value'}, ...])."
        )
    messages: list[Message] = []
    if layout == "sharegpt" and isinstance(record.get("system"), str) and record["system"]:
        messages.append({"role": "system", "content": record["system"]})
    for i, turn in enumerate(record[key]):
        spot = f"{where} turn {i}"
        if not isinstance(turn, dict):
            raise CorpusError(f"{spot} is a {type(turn).__name__}, not a turn.")
        role = turn.get("role") if layout == "messages" else turn.get("from")
        roles = ROLES if layout == "messages" else SHAREGPT
        if role not in roles:
            raise CorpusError(f"{spot} has the role {role!r}, which is none of {sorted(roles)}.")
        if layout == "messages":
            message = {"role": role, "content": text_of(turn.get("content"), spot)}
            if turn.get("tool_calls"):
                message["tool_calls"] = turn["tool_calls"]
        elif role == "function_call":
            message = tool_call(text_of(turn.get("value"), spot))
        else:
            message = {"role": roles[role], "content": text_of(turn.get("value"), spot)}
        messages.append(message)
    return messages, tool_list(record.get("tools"), where)


def read_conversations(
    path: str, layout: str, hf_split: str = "train"
) -> list[tuple[list[Message], Optional[list[dict]]]]:
    """Every record of a .json / .jsonl file, of the dir's files in name order, or of a Hugging Face dataset's split
    (`hf:<name>`); errors name file and record."""
    if path.startswith("hf:"):
        records = read_json_records(path, "a chat", hf_split)
        return [conversation(record, f"{path}[{hf_split}]: record {i}", layout) for i, record in enumerate(records)]
    where = Path(path).expanduser()
    files = sorted(p for p in where.iterdir() if p.suffix in (".json", ".jsonl")) if where.is_dir() else [where]
    if not files:
        raise CorpusError(f"data.path={path!r} is a dir without .json or .jsonl files.")
    out = []
    for file in files:
        for i, record in enumerate(read_json_records(str(file), "a chat (messages or ShareGPT)")):
            out.append(conversation(record, f"{file}: record {i}", layout))
    return out


class ChatTemplate:
    """Renders conversations: the tokenizer's own template, or `chat_template` (chatml, a Jinja string or file)."""

    def __init__(self, tokenizer: Tokenizer, chat_template: Optional[str]) -> None:
        hf = getattr(tokenizer, "hf", None)
        if chat_template is None and getattr(hf, "chat_template", None):
            self.template = hf.chat_template
        elif chat_template in (None, "chatml"):
            self.template = CHATML
        elif "{{" in chat_template or "{%" in chat_template:
            self.template = chat_template
        else:
            file = Path(chat_template).expanduser()
            if not file.is_file():
                raise ConfigError(
                    f"data.chat_template={chat_template!r} is no file and no Jinja template: give chatml, a "
                    "template string ({{ ... }}) or the path of a .jinja file."
                )
            self.template = file.read_text(encoding="utf-8")
        self.tokens = {"eos_token": EOS_MARK if hf is None else hf.eos_token}
        if hf is not None:
            self.tokens.update({k: v for k, v in hf.special_tokens_map.items() if isinstance(v, str)})

    def __call__(self, messages: list[Message], tools: Optional[list[dict]], generation_prompt: bool) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(
            [messages], tools=tools, chat_template=self.template, add_generation_prompt=generation_prompt, **self.tokens
        )
        return rendered[0]


def spans(render: ChatTemplate, messages: list[Message], tools: Optional[list[dict]], where: str):
    """(the whole conversation's text, [(start, end) of each assistant turn in it])."""
    try:
        whole = render(messages, tools, False)
        turns = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, upto = render(messages[:k], tools, True), render(messages[: k + 1], tools, False)
            if not (upto.startswith(before) and whole.startswith(upto)):
                raise CorpusError(
                    f"{where}: the chat template renders the turns before assistant turn {k} differently once "
                    "later turns follow, so the assistant's tokens cannot be told apart: use a template that "
                    "keeps the history as it is (data.chat_template=chatml, or your own)."
                )
            turns.append((len(before), len(upto.rstrip()) if upto.rstrip() else len(upto)))
    except CorpusError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever Jinja raises, the sentence names the record
        raise CorpusError(f"{where}: the chat template failed to render it ({type(e).__name__}: {e}).") from e
    return whole, turns


def encode_text(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """Token ids of rendered text; the byte tokenizer's EOS mark becomes its EOS id."""
    if EOS_MARK not in text:
        return tokenizer.encode_batch([text])[0].astype(np.int64)
    pieces = tokenizer.encode_batch(text.split(EOS_MARK))
    eos = np.array([tokenizer.eos_id], dtype=np.int64)
    return np.concatenate([part for p in pieces for part in (p.astype(np.int64), eos)][:-1])


def encode(
    tokenizer: Tokenizer, text: str, turns: list[tuple[int, int]], train_on: str
) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) of the rendered conversation, labels shifted (labels[t] is token t + 1) and -100
    except on the trained turns' tokens. Each piece (between turns, a turn) is tokenized on its own."""
    targets = turns if train_on == "assistant" else turns[-1:] if train_on == "last" else [(0, len(text))]
    cuts = sorted({0, len(text), *(c for span in targets for c in span)})
    pieces = [(a, b, any(s <= a and b <= e for s, e in targets)) for a, b in zip(cuts, cuts[1:])]
    ids = [encode_text(tokenizer, text[a:b]) for a, b, _ in pieces]
    tokens = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    trained = np.concatenate([np.full(len(i), t) for i, (_, _, t) in zip(ids, pieces)]) if ids else tokens.astype(bool)
    labels = np.where(trained, tokens, IGNORE_INDEX)[1:]
    return tokens[:-1], labels.astype(np.int64)


class ChatDataModule(RecordsDataModule):
    def __init__(
        self,
        path: str,
        seq_len: int = 1024,
        layout: str = "auto",
        chat_template: Optional[str] = None,
        train_on: str = "assistant",
        overlong: str = "turns",
        packing: bool = False,
        **shared: Any,
    ) -> None:
        super().__init__(path, seq_len=seq_len, **shared)
        for key, value, choices in (("layout", layout, LAYOUTS), ("train_on", train_on, TRAIN_ON)):
            if value not in choices:
                raise ConfigError(f"data.{key}={value!r}: use one of {', '.join(choices)}.")
        if overlong not in OVERLONG:
            raise ConfigError(f"data.overlong={overlong!r}: use one of {', '.join(OVERLONG)}.")
        self.layout, self.chat_template, self.train_on = layout, chat_template, train_on
        self.overlong, self.packing = overlong, packing
        self.held_out: list[tuple[list[Message], Optional[list[dict]]]] = []

    @cached_property
    def render(self) -> ChatTemplate:
        return ChatTemplate(self.tokenizer, self.chat_template)

    def records(self) -> list:
        return read_conversations(self.path, self.layout, self.hf_split)

    def cut(self, messages: list[Message], tools: Optional[list[dict]], where: str):
        """(input_ids, labels, how) of the conversation within seq_len as data.overlong says, how being "" (it
        fits), "turns" (later turns dropped) or "truncated"; None when it is dropped."""
        text, turns = spans(self.render, messages, tools, where)
        ids, labels = encode(self.tokenizer, text, turns, self.train_on)
        if len(ids) <= self.seq_len:
            return ids, labels, ""
        if self.overlong == "truncate":
            return ids[: self.seq_len], labels[: self.seq_len], "truncated"
        if self.overlong == "turns":
            ends = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
            for k in reversed(ends[:-1]):
                text, turns = spans(self.render, messages[: k + 1], tools, where)
                ids, labels = encode(self.tokenizer, text, turns, self.train_on)
                if len(ids) <= self.seq_len:
                    return ids, labels, "turns"
        return None

    def build_splits(self) -> dict[str, Dataset]:
        items, counts, conversations = [], {"turns": 0, "truncated": 0, "dropped": 0, "no_assistant": 0}, []
        for i, (messages, tools) in enumerate(self.records()):
            if not any(m["role"] == "assistant" for m in messages):
                counts["no_assistant"] += 1
                continue
            fitted = self.cut(messages, tools, f"{self.path}: conversation {i}")
            if fitted is None:
                counts["dropped"] += 1
                continue
            ids, labels, how = fitted
            if how:
                counts[how] += 1
            items.append((ids, labels))
            conversations.append((messages, tools))
        if not items:
            raise CorpusError(
                f"No conversation of {self.path} trains at data.seq_len={self.seq_len} ({counts['no_assistant']} "
                f"without an assistant turn, {counts['dropped']} too long): raise data.seq_len or fix the data."
            )
        parts = self.cut_splits(items, "conversation")
        self.held_out = conversations[len(parts["train"]) :]
        lengths = np.array([len(ids) for ids, _ in parts["train"]])
        log.info(
            f"{len(items)} conversations ({counts['turns']} cut to their turns that fit, {counts['truncated']} "
            f"truncated, {counts['dropped']} dropped at seq_len {self.seq_len}, {counts['no_assistant']} without an "
            f"assistant turn skipped) -> {'/'.join(str(len(part)) for part in parts.values())} train/val/test; "
            "padding would be "
            f"{padding_share(lengths, self.global_batch_size):.0%} of a batch" + (", packed" if self.packing else "")
        )
        if self.packing:
            return {name: PackedRows(part, self.seq_len) for name, part in parts.items()}
        return {name: Items(part, label_targets(part)) for name, part in parts.items()}

    def collate_fn(self):
        return packed_collate(self.tokenizer.eos_id) if self.packing else pad_collate(self.tokenizer.eos_id)

    def sample_prompts(self, n: int) -> list[str]:
        """The first `n` held-out conversations up to their last assistant turn, rendered with the generation prompt:
        what the samples callback completes."""
        prompts = []
        for messages, tools in self.held_out[:n]:
            last = max(k for k, m in enumerate(messages) if m["role"] == "assistant")
            text = self.render(messages[:last], tools, True)
            prompts.append(text.replace(EOS_MARK, ""))
        return prompts
