"""Reward functions for the GRPO tests (model.objective.rewards), named by `_target_` as a user's would be."""

from __future__ import annotations

from typing import Any


def digit_share(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """The share of a completion's characters that are digits: it varies between the samples of a prompt even from
    an untrained model, so every group has a spread (advantages that are not all 0)."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def one_too_few(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """A planted mistake: one value short."""
    return [0.0] * (len(completions) - 1)
