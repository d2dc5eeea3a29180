"""GPT-2's hand-written adapter (src/architectures/handwritten.py's interface): the one architecture here that
transformers ships no plans for. Everything the template knows only of GPT-2 lives here.

Tensor parallel. torch's styles accept `nn.Linear` only, and HF GPT-2 uses `Conv1D` (weight stored [in, out]):
`prepare_tensor_parallel` swaps in `nn.Linear` with the transposed weight (the same values, the same math). c_attn
fuses q, k, v: its outputs are [q | k | v], each n_embd wide, and a plain column split would give rank 0 all of q
and half of k; its rows are reordered to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (rank r's heads), so the split hands
each rank its own heads' q, k and v, and the attention module, told its per-rank head count, splits them as usual.
Its checkpoints keep that layout (it is what resumes) and say so under LAYOUT_KEY; `to_hf` turns such a full state
dict back into HF GPT-2's own (eval.py, export-hf, resuming under another strategy), `from_hf` is its inverse.

Pipeline: `Stage` holds blocks [lo, hi), led by the embeddings (first stage) or followed by ln_f + lm_head (last);
GPT-2's body needs its position embeddings on the first stage only.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

import torch
from torch import nn

from src.architectures.handwritten import Adapter, Fill
from src.utils.config import ConfigError

COLWISE, ROWWISE = ("attn.c_attn", "mlp.c_fc"), ("attn.c_proj", "mlp.c_proj")  # the Conv1D layers that become Linear
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


def to_linear(conv: nn.Module, order: Optional[torch.Tensor] = None) -> nn.Linear:
    """An nn.Linear computing what the Conv1D `conv` computes (rows reordered by `order`)."""
    n_in, n_out = conv.weight.shape
    linear = nn.Linear(n_in, n_out, device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        weight, bias = conv.weight.t(), conv.bias
        if order is not None:
            weight, bias = weight[order], bias[order]
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    return linear


def causal_mask(t: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive [1, 1, t, t] mask: query i sees keys j <= i."""
    i, j = torch.arange(t, device=device)[:, None], torch.arange(t, device=device)[None, :]
    return torch.zeros((t, t), dtype=dtype, device=device).masked_fill(j > i, torch.finfo(dtype).min)[None, None]


class Stage(nn.Module):
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


class GPT2Adapter(Adapter):
    model_type = "gpt2"
    shape_keys = ("n_layer", "n_head", "n_embd")
    tp_plan = {**{name: "colwise" for name in COLWISE}, **{name: "rowwise" for name in ROWWISE}}
    stage = Stage

    def check_divisible(self, config: Any, tp: int) -> None:
        if config.n_head % tp or config.n_embd % tp:
            raise ConfigError(
                f"model.n_head={config.n_head} and model.n_embd={config.n_embd} must both divide by "
                f"trainer.strategy.tensor_parallel_size={tp}: pick a tensor-parallel size that divides them."
            )

    def prepare_tensor_parallel(self, blocks: list[nn.Module], config: Any, tp: int) -> None:
        """The Conv1D layers become Linear (c_attn's rows in per-rank head order); attention told its heads."""
        order = qkv_order(config.n_embd, config.n_head, tp)
        for block in blocks:
            for name in COLWISE + ROWWISE:
                parent, child = name.split(".")
                owner = getattr(block, parent)
                owner.register_module(child, to_linear(getattr(owner, child), order if child == "c_attn" else None))
            attn = block.attn  # its forward splits c_attn's output by split_size and views it per head
            attn.num_heads, attn.embed_dim, attn.split_size = (
                config.n_head // tp,
                config.n_embd // tp,
                config.n_embd // tp,
            )

    def tp_layout(self, config: Any, tp: int) -> Optional[dict[str, Any]]:
        return {"model_type": self.model_type, "size": tp, "n_head": config.n_head}

    def to_hf(self, state_dict: dict[str, torch.Tensor], size: int, n_head: int) -> dict[str, torch.Tensor]:
        """A full state dict in the Linear layout -> HF GPT-2's Conv1D layout (same names, [in, out] weights)."""
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

    def from_hf(self, state_dict: dict[str, torch.Tensor], size: int, n_head: int) -> dict[str, torch.Tensor]:
        """`to_hf`'s inverse: HF GPT-2's Conv1D layout -> the Linear layout for `size` ranks."""
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

    def fill(self, config: Any) -> Fill:
        """GPT-2's initialisation scheme (as transformers' GPT2PreTrainedModel._init_weights): N(0, 0.02) for
        embeddings and projections, scaled by 1/sqrt(2 n_layer) for the two residual projections (c_proj),
        ones for LayerNorm gains, zeros for biases."""
        std = config.initializer_range
        residual_std = std / math.sqrt(2 * config.n_layer)

        def fill(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
            if name.endswith(".bias"):
                tensor.zero_()
            elif ".ln_" in name:
                tensor.fill_(1.0)
            else:
                tensor.normal_(0.0, residual_std if name.endswith("c_proj.weight") else std, generator=generator)

        return fill

    def param_count(self, config: Any) -> int:
        """Exact, with tied embeddings: 12d^2 + 13d per block, token and position embeddings, final LayerNorm."""
        d = config.n_embd
        return config.n_layer * (12 * d**2 + 13 * d) + (config.vocab_size + config.n_positions) * d + 2 * d


GPT2 = GPT2Adapter()
