"""Mixture-of-experts models (Mixtral, Qwen2/3-MoE, OLMoE, ...): the router's load-balancing loss, trained as
transformers defines it and the same for any number of devices.

transformers' `load_balancing_loss_func` (each MoE model's module has its own; Switch Transformer's loss, eqs. 4-6)
averages the routing statistics over all the tokens of the batch it is given, so its value depends on how a global
batch is split into micro-batches: on 1 process x 8 sequences it is not the mean of 2 ranks x 4. Here it is called on
each sequence alone (its own tokens, padding masked as transformers masks it) and averaged over the optimizer step's
sequences, as DeepSeek-V3's sequence-wise balance loss is: for a micro-batch of one sequence it is transformers'
value, and 1 x 8 = 2 x 4 = 1 x 4 x 2 exactly. What this adds to the library: that per-sequence reduction, and the
per-expert token counts the run logs.

Pipeline stages hold a share of the layers each: they carry the loss's per-expert totals from stage to stage
instead (src/parallel/pipeline/stages.py, `Routing`).
"""

from __future__ import annotations

import inspect
import sys
from typing import Callable, Optional

import torch
from torch import nn

from src.utils.config import ConfigError

SWITCH = ["gate_logits", "num_experts", "top_k", "attention_mask"]  # the Switch Transformer loss's parameters


def balance_loss_function(model: nn.Module) -> Optional[Callable]:
    """The model's own `load_balancing_loss_func` when its causal LM adds one (it has `router_aux_loss_coef`,
    `num_experts` and `num_experts_per_tok`, as transformers' MoE causal LMs do); None for dense models. A router
    loss of another form (Doge's product-key experts: another signature, no top-k) is refused in one sentence:
    `sequence_balance` would read its router logits wrongly."""
    fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    needed = ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")
    if not (callable(fn) and all(hasattr(model, name) for name in needed)):
        return None
    if list(inspect.signature(fn).parameters) != SWITCH or not isinstance(model.num_experts_per_tok, int):
        raise ConfigError(
            f"{model.config.model_type}'s router load-balancing loss is not the Switch Transformer form this template "
            "takes per sequence (over the experts' top-k of each token): set model.router_aux_loss=false to train "
            "without it."
        )
    return fn


def sequence_balance(
    fn: Callable,
    router_logits: tuple[torch.Tensor, ...],
    attention_mask: Optional[torch.Tensor],
    batch: int,
    num_experts: int,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sum over the batch's sequences of `fn` on each sequence alone, the tokens routed to each expert over all
    layers and real tokens). `router_logits`: one [batch x seq, experts] tensor per MoE layer."""
    losses = each_sequence(fn, router_logits, attention_mask, batch, num_experts, top_k)
    with torch.no_grad():  # scatter_add, weighted by the mask: no host sync (as transformers counts)
        device = router_logits[0].device
        weight = attention_mask.reshape(-1).float() if attention_mask is not None else None
        counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
        for layer in router_logits:
            picked = torch.topk(layer.float(), top_k, dim=-1).indices  # softmax keeps the order: same experts
            w = weight.repeat_interleave(top_k) if weight is not None else torch.ones(picked.numel(), device=device)
            counts.scatter_add_(0, picked.reshape(-1), w)
    return losses.sum(), counts


def each_sequence(
    fn: Callable,
    router_logits: tuple[torch.Tensor, ...],
    attention_mask: Optional[torch.Tensor],
    batch: int,
    num_experts: int,
    top_k: int,
) -> torch.Tensor:
    """`fn` on each sequence of the batch alone, its padding masked: [batch]."""
    rows = router_logits[0].shape[0] // batch
    losses = []
    for b in range(batch):
        mine = tuple(layer[b * rows : (b + 1) * rows] for layer in router_logits)
        mask = attention_mask[b : b + 1] if attention_mask is not None else None
        losses.append(fn(mine, num_experts, top_k, mask))
    return torch.stack(losses)
