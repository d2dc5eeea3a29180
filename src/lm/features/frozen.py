"""model.freeze: part of a plain model frozen (requires_grad False) before the optimizer is built, so the frozen part
has no gradient, no optimizer state and no gradient all-reduce (DDP skips it; FSDP2 shards it and computes no
gradient for it). The model stays a plain transformers model: export-hf writes it as any other.

  null            everything trains
  embeddings      the input embeddings (and GPT-2's position table); with tied embeddings the head is that matrix
  all_but_head    everything but the output layer (the head: with tied embeddings the input embeddings train too)
  {first_k_blocks: K}  the embeddings and the first K decoder blocks (the lower layers)
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from src.lm import hf
from src.utils.config import ConfigError

log = logging.getLogger(__name__)

CHOICES = "null | embeddings | all_but_head | {first_k_blocks: K}"


def check(freeze: Any, adapted: bool) -> Optional[tuple[str, int]]:
    """(the kind, K) of model.freeze, None when off; one sentence where it is not one of CHOICES or an adapter is on."""
    if freeze is None:
        return None
    if adapted:
        raise ConfigError(
            f"model.freeze={freeze} with an adapter (model.lora, model/peft): an adapter already freezes the whole "
            "model; set model.freeze=null."
        )
    if freeze in ("embeddings", "all_but_head"):
        return str(freeze), 0
    k = dict(freeze).get("first_k_blocks") if hasattr(freeze, "keys") and len(freeze) == 1 else None
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"model.freeze={freeze} is not one of {CHOICES} (K >= 1): pick one of those.")
    return "first_k_blocks", k


def apply(model: torch.nn.Module, choice: Optional[tuple[str, int]], added: list[str]) -> torch.nn.Module:
    """Freeze what `choice` names in `model` (a transformers model, on any device or meta); what the objective added
    (a reward head) trains. Logs the trainable and total parameters (tied weights once); returns `model`."""
    if choice is None:
        return model
    kind, k = choice
    layers = hf.decoder_layers(model)
    if kind == "first_k_blocks" and k > len(layers):
        raise ConfigError(f"model.freeze.first_k_blocks={k} but the model has {len(layers)} blocks: lower it.")
    head = model.get_output_embeddings()
    if kind == "all_but_head":
        frozen = [p for p in model.parameters() if head is None or all(p is not q for q in head.parameters())]
    else:
        frozen = list(_embeddings(model, layers).parameters())
        frozen += [p for block in layers[:k] for p in block.parameters()]
    for p in frozen:
        p.requires_grad_(False)
    for name in added:
        model.get_parameter(name).requires_grad_(True)
    params = {id(p): p for p in model.parameters()}.values()
    trainable = sum(p.numel() for p in params if p.requires_grad)
    log.info(f"model.freeze={kind}{f' {k}' if k else ''}: {trainable:,} of {sum(p.numel() for p in params):,} "
             "parameters train")  # fmt: skip
    return model


def _embeddings(model: torch.nn.Module, layers: torch.nn.ModuleList) -> torch.nn.ModuleList:
    """The model's input embeddings and every other embedding table before its blocks (GPT-2's wpe)."""
    body = next(m for m in model.modules() if any(c is layers for c in m.children()))
    tables = [m for m in body.children() if isinstance(m, torch.nn.Embedding)]
    return torch.nn.ModuleList(
        [model.get_input_embeddings(), *[t for t in tables if t is not model.get_input_embeddings()]]
    )
