"""Verifiable rewards for model/objective=grpo, with TRL's reward-function signature: `f(prompts, completions,
**columns) -> list[float]`, one value per completion, `columns` the data's other fields by name (one value per
completion). Named in a config as `{_target_: src.lm.objectives.verifiers.exact_match, _partial_: true}`; a function of
your own is named the same way."""

from __future__ import annotations

import re
from typing import Any


def exact_match(prompts: list[str], completions: list[str], answer: list[Any], **columns: Any) -> list[float]:
    """1 where the completion, stripped of surrounding whitespace, is the reference `answer` (as text), else 0."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


def format_match(prompts: list[str], completions: list[str], pattern: str = r".+", **columns: Any) -> list[float]:
    """1 where the whole completion matches the regular expression `pattern` (e.g. `\\d+` for a bare number)."""
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.fullmatch(c) is not None) for c in completions]
