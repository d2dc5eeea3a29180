"""GPT-2's tensor-parallel weight layout and the way back: the one place that knows both.

trainer=tp (and trainer=pipeline with tensor_parallel_size > 1) swaps GPT-2's Conv1D layers (weight stored
[in, out]) for nn.Linear ([out, in]) and reorders c_attn's rows so that each rank's heads are contiguous
(src/distributed/tensor_parallel.py). Its checkpoints keep that layout and say so under LAYOUT_KEY. Models with
transformers' own tensor-parallel plan (Llama, Qwen2, Mistral) keep their layout: nothing here applies to them.

`hf_layout` turns such a full state dict into HF GPT-2's own (eval.py, export-hf, resuming under another
strategy); `tp_layout` is its inverse, for a full state dict loaded into a tensor-parallel GPT-2.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

# GPT-2's plan: the suffixes of the Conv1D layers that become Linear, and how each is split
COLWISE, ROWWISE = ("attn.c_attn", "mlp.c_fc"), ("attn.c_proj", "mlp.c_proj")
GPT2_PLAN = {**{name: "colwise" for name in COLWISE}, **{name: "rowwise" for name in ROWWISE}}
# the plan styles trainer=tp implements (with torch's DTensor styles: src/distributed/tensor_parallel.py)
STYLES = (
    *("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "replicated_with_grad_allreduce"),
    *("packed_colwise", "packed_rowwise", "moe_tp_experts"),  # experts: src/distributed/experts.py
)
LAYOUT_KEY = "tensor_parallel"  # checkpoint entry: {"size": tp, "n_head": heads} when weights are in our layout
_SWAPPED = re.compile(r"\.(" + "|".join(re.escape(n) for n in COLWISE + ROWWISE) + r")\.(weight|bias)$")


def qkv_order(n_embd: int, n_head: int, tp: int) -> torch.Tensor:
    """Row order of the Linear c_attn: position i of the new layout holds HF row order[i]."""
    per_rank = n_embd // tp  # n_head / tp heads of head_dim each
    return torch.cat(
        [
            torch.arange(part * n_embd + r * per_rank, part * n_embd + (r + 1) * per_rank)
            for r in range(tp)
            for part in range(3)
        ]
    )


def layout(config: Any, tp: int) -> Optional[dict[str, int]]:
    """The checkpoint's LAYOUT_KEY entry when its weights are in our GPT-2 Linear layout; None for HF's own."""
    shipped = getattr(config, "base_model_tp_plan", None)
    if config.model_type == "gpt2" and not shipped:
        return {"size": tp, "n_head": config.n_head}
    return None


def hf_layout(state_dict: dict[str, torch.Tensor], size: int, n_head: int) -> dict[str, torch.Tensor]:
    """A full state dict in our Linear layout -> HF GPT-2's Conv1D layout (same names, [in, out] weights)."""
    out = dict(state_dict)
    for key, tensor in state_dict.items():
        match = _SWAPPED.search(key)
        if match is None:
            continue
        if match.group(1) == "attn.c_attn":
            n_embd = tensor.shape[-1] if match.group(2) == "weight" else tensor.shape[0] // 3
            tensor = tensor[torch.argsort(qkv_order(n_embd, n_head, size))]
        out[key] = tensor.t().contiguous() if match.group(2) == "weight" else tensor
    return out


def tp_layout(state_dict: dict[str, torch.Tensor], size: int, n_head: int) -> dict[str, torch.Tensor]:
    """`hf_layout`'s inverse: a full state dict in HF GPT-2's Conv1D layout -> our Linear layout for `size` ranks."""
    out = dict(state_dict)
    for key, tensor in state_dict.items():
        match = _SWAPPED.search(key)
        if match is None:
            continue
        if match.group(2) == "weight":
            tensor = tensor.t()
        if match.group(1) == "attn.c_attn":
            n_embd = tensor.shape[-1] if match.group(2) == "weight" else tensor.shape[0] // 3
            tensor = tensor[qkv_order(n_embd, n_head, size)]
        out[key] = tensor.contiguous()
    return out
