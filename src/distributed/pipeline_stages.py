"""The pipeline stages of a decoder LM: which modules each stage holds and how it runs them.

What a stage holds is read from the model: transformers ships `config.base_model_pp_plan` (Llama, Qwen2,
Mistral, ...): the body's parts in order (embed_tokens -> layers -> norm). The first stage holds the parts before
the layer list and its share of the layers; the last its share and the parts after, plus the LM head. GPT-2 ships
no plan (and adds learned positions to its embeddings): `GPT2Stage` is its hand-written adapter.

A stage runs its layers as the model's own forward would on unpadded, packed text (the pipeline's input): causal
attention (a banded mask for sliding-window layers), and rotary position embeddings computed from positions
0..T-1 in every stage by the body's `rotary_emb`, which holds no parameters.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from src.utils.config import ConfigError


def stage_ranges(n_layer: int, n_stages: int) -> list[tuple[int, int]]:
    per = n_layer // n_stages
    return [(i * per, (i + 1) * per) for i in range(n_stages)]


def causal_mask(t: int, dtype: torch.dtype, device: torch.device, window: Optional[int] = None) -> torch.Tensor:
    """Additive [1, 1, t, t] mask: query i sees keys j <= i (and i - j < window for a sliding window)."""
    i, j = torch.arange(t, device=device)[:, None], torch.arange(t, device=device)[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True)
    return torch.zeros((t, t), dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


class GPT2Stage(nn.Module):
    """Blocks [lo, hi) of a GPT2LMHeadModel, led by the embeddings (first stage) or followed by ln_f + lm_head (last)."""

    def __init__(self, hf: nn.Module, lo: int, hi: int, first: bool, last: bool, eager: bool) -> None:
        super().__init__()
        t = hf.transformer
        self.first, self.last = first, last
        self.blocks = nn.ModuleList(t.h[lo:hi])
        self.embed = nn.ModuleDict({"wte": t.wte, "wpe": t.wpe, "drop": t.drop}) if first else None
        self.head = nn.ModuleDict({"ln_f": t.ln_f, "lm_head": hf.lm_head}) if last else None
        self.eager = eager  # eager attention adds a mask to its scores; SDPA without one is causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # as GPT2Model.forward: token + position embeddings, then dropout
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            x = self.embed["drop"](self.embed["wte"](x) + self.embed["wpe"](positions))
        # SDPA without a mask is causal (is_causal); eager adds this mask to its scores
        mask = causal_mask(x.shape[1], x.dtype, x.device) if self.eager else None
        for block in self.blocks:
            x = block(x, None, mask)
        if self.last:
            x = self.head["lm_head"](self.head["ln_f"](x))
        return x

    def input_embedding(self) -> Optional[nn.Module]:
        return self.embed["wte"] if self.first else None

    def output_embedding(self) -> Optional[nn.Module]:
        return self.head["lm_head"] if self.last else None


class DecoderStage(nn.Module):
    """Layers [lo, hi) of a decoder LM whose config has a pipeline plan, with the parts the plan puts before
    the layers (first stage) or after them, plus the LM head (last stage)."""

    def __init__(self, hf: nn.Module, lo: int, hi: int, first: bool, last: bool, eager: bool) -> None:
        super().__init__()
        body, config = hf.base_model, hf.config
        names = list(config.base_model_pp_plan)
        split = names.index(layers_name(hf))
        self.first, self.last = first, last
        self.inputs = nn.ModuleDict({n: getattr(body, n) for n in names[:split]}) if first else None
        self.layers = nn.ModuleList(getattr(body, names[split])[lo:hi])
        self.outputs = nn.ModuleDict({n: getattr(body, n) for n in names[split + 1 :]}) if last else None
        self.lm_head = hf.get_output_embeddings() if last else None
        self.rotary = getattr(body, "rotary_emb", None)  # no parameters: every stage computes its positions' angles
        types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        # Mistral: every layer slides when sliding_window is set; Qwen2 and others say per layer (layer_types)
        self.windows = [
            window if (types[i] == "sliding_attention" if types else window) else None for i in range(lo, hi)
        ]
        self.eager = eager

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            for module in self.inputs.values():
                x = module(x)
        t = x.shape[1]
        positions = torch.arange(t, device=x.device).unsqueeze(0)
        rotary = {"position_embeddings": self.rotary(x, positions)} if self.rotary is not None else {}
        masks: dict[Optional[int], Optional[torch.Tensor]] = {}
        for layer, window in zip(self.layers, self.windows):
            if window not in masks:  # SDPA without a mask is causal (is_causal); eager and windows need one
                banded = window is not None and window < t
                masks[window] = causal_mask(t, x.dtype, x.device, window) if self.eager or banded else None
            x = layer(x, attention_mask=masks[window], position_ids=positions, **rotary)
        if self.last:
            for module in self.outputs.values():
                x = module(x)
            x = self.lm_head(x)
        return x

    def input_embedding(self) -> Optional[nn.Module]:
        return next(iter(self.inputs.values())) if self.first else None

    def output_embedding(self) -> Optional[nn.Module]:
        return self.lm_head


def layers_name(hf: nn.Module) -> str:
    """The name of the body's decoder-layer list in the pipeline plan ("layers")."""
    plan = getattr(hf.config, "base_model_pp_plan", None) or {}
    lists = [name for name in plan if isinstance(getattr(hf.base_model, name, None), nn.ModuleList)]
    if len(lists) != 1:
        raise ConfigError(
            f"{hf.config.model_type}'s pipeline plan {list(plan)} does not name one layer list: "
            "train it with trainer=fsdp or trainer=ddp."
        )
    return lists[0]


def stage_class(config) -> type[nn.Module]:
    """DecoderStage for models with transformers' pipeline plan, GPT2Stage for GPT-2; one sentence otherwise."""
    if getattr(config, "base_model_pp_plan", None):
        return DecoderStage
    if config.model_type == "gpt2":
        return GPT2Stage
    raise ConfigError(
        f"trainer=pipeline needs a pipeline plan and {config.model_type}'s config has none "
        "(base_model_pp_plan): GPT-2, Llama, Qwen2, Mistral and the other models transformers ships a "
        "plan for work; train this one with trainer=fsdp or trainer=ddp."
    )


def prune(hf: nn.Module, layers: nn.ModuleList, keep: set[int], first: bool, last: bool) -> None:
    """Drop what this rank does not hold; the kept modules keep their names (model.model.layers.3..., or GPT-2's
    model.transformer.h.3...), so checkpoint shards merge under the plain HF names."""
    for i in range(len(layers)):
        if i not in keep:
            layers[i] = nn.Identity()
    body = hf.base_model
    if getattr(hf.config, "base_model_pp_plan", None):
        names = list(hf.config.base_model_pp_plan)
        split = names.index(layers_name(hf))
        before, after = names[:split], names[split + 1 :]
    else:  # GPT-2
        before, after = ["wte", "wpe"], ["ln_f"]
    for name in before if not first else []:
        setattr(body, name, None)
    for name in after if not last else []:
        setattr(body, name, None)
    if not last:
        hf.lm_head = None
