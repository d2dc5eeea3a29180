"""generate.py chat=true: a conversation on stdin/stdout, rendered by the chat template the checkpoint trained with.

Each stdin line is a user turn (`tool: ...` a tool's result, read as the `tool` role's turn); the assistant's reply
streams to stdout as it is written and stops at the end of its turn (the template's EOS or end-of-turn token), its
tool calls (`<tool_call>{...}</tool_call>`) shown as they come and listed once it ends. End of input ends the chat.
A turn's randomness is keyed by (seed, turn number), as a prompt's by its number (src/run/sampling.py).
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any, Optional

from src.lm.data.chat import ChatTemplate, encode_text
from src.run.sampling import Printer, complete, stop_ids
from src.utils.config import ConfigError

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def template(tokenizer: Any, data: Any, given: Optional[str]) -> ChatTemplate:
    """chat_template= if given, else the one the checkpoint's chat data rendered with, else the tokenizer's own."""
    if given is not None:
        return ChatTemplate(tokenizer, given)
    if str(data.get("_target_", "")).endswith("ChatDataModule"):
        return ChatTemplate(tokenizer, data.get("chat_template"))
    if getattr(getattr(tokenizer, "hf", None), "chat_template", None):
        return ChatTemplate(tokenizer, None)
    raise ConfigError(
        "chat=true needs a chat template: this checkpoint's tokenizer has none and it was not trained on data=chat; "
        "pass chat_template=chatml (or a Jinja string or file) to choose one."
    )


def tool_calls(reply: str) -> list[str]:
    """Each tool call of a reply as `name(arguments)` (or its raw text where it is not JSON)."""
    calls = []
    for raw in TOOL_CALL.findall(reply):
        try:
            call = json.loads(raw)
            calls.append(f"{call['name']}({json.dumps(call.get('arguments', {}))})")
        except (json.JSONDecodeError, KeyError, TypeError):
            calls.append(raw)
    return calls


def chat(model: Any, tokenizer: Any, render: ChatTemplate, cfg: Any, synced: bool = False, stdin=None) -> int:
    """Runs the conversation until stdin ends; the number of assistant turns."""
    stdin, stops = stdin or sys.stdin, stop_ids(tokenizer)
    messages = [{"role": "system", "content": cfg.system}] if cfg.get("system") else []
    turn = 0
    for line in stdin:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        role, text = ("tool", line[5:].strip()) if line.startswith("tool:") else ("user", line)
        messages.append({"role": role, "content": text})
        ids = encode_text(tokenizer, render(messages, None, True)).tolist()
        sys.stdout.write("assistant: ")
        sys.stdout.flush()
        printer = Printer(tokenizer, stops)
        reply = tokenizer.decode(complete(model, ids, cfg, turn, stops, synced=synced, streamer=printer))
        for call in tool_calls(reply):
            print(f"[tool call] {call}", flush=True)
        messages.append({"role": "assistant", "content": reply})
        turn += 1
    return turn
