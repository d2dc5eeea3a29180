"""The interface of a hand-written architecture adapter: what the template needs to know of a model for which
transformers ships no plans (GPT-2: no `base_model_tp_plan`, no `base_model_pp_plan`, Conv1D weights). Every
other decoder needs none: its plans are read from its config. The code asks `adapter_for(model_type)` (src/architectures/__init__.py),
never the model type itself; a future hand-written architecture implements these members and is listed there.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

Fill = Callable[[str, torch.Tensor, torch.Generator], None]  # (parameter name, tensor, generator): fills in place


class Adapter:
    model_type: str
    """transformers' model_type this adapter is for."""

    shape_keys: tuple[str, ...] = ()
    """Its `model:` node's top-level keys that are config fields (model=gpt2's n_layer, n_head, n_embd)."""

    tp_plan: dict[str, str] = {}
    """How one decoder layer splits over the tensor-parallel ranks, in transformers' style names
    ({"attn.c_attn": "colwise", ...}), used when the config ships no `base_model_tp_plan`."""

    def check_divisible(self, config: Any, tp: int) -> None:
        """One sentence when `tp` ranks cannot each hold whole heads and an equal share of the MLP."""

    def prepare_tensor_parallel(self, blocks: list[nn.Module], config: Any, tp: int) -> None:
        """Make `blocks` splittable by `tp_plan` with torch's styles, in place, before they are split."""

    def tp_layout(self, config: Any, tp: int) -> Optional[dict[str, Any]]:
        """The checkpoint entry (LAYOUT_KEY) saying its tensor-parallel weights are not in transformers' layout,
        or None when they are."""
        return None

    def to_hf(self, state_dict: dict[str, torch.Tensor], **entry: Any) -> dict[str, torch.Tensor]:
        """A full state dict in the tensor-parallel layout `entry` -> transformers' own layout."""
        return state_dict

    def from_hf(self, state_dict: dict[str, torch.Tensor], **entry: Any) -> dict[str, torch.Tensor]:
        """`to_hf`'s inverse."""
        return state_dict

    stage: Optional[type[nn.Module]] = None
    """Its pipeline stage (`stage(hf_model, lo, hi, first, last, eager)`), used when the config ships no
    `base_model_pp_plan`."""

    def fill(self, config: Any) -> Fill:
        """Its own initialisation scheme, drawn per parameter (src/lm/init.py)."""
        raise NotImplementedError

    def param_count(self, config: Any) -> int:
        """Its exact parameter count, from the config alone."""
        raise NotImplementedError
