"""The LM module's adapters: model.lora (peft's LoRA) or model/peft (any peft config: prefix, prompt or P-tuning;
or the template's bottleneck adapters, src/lm/features/bottleneck.py). Only the adapter trains (and what the objective
adds, a reward head); the base weights are frozen. An adapted model is built eagerly on every rank (no deferred
init)."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from src.lm import hf
from src.lm.features import bottleneck, frozen
from src.lm.features.flops import FlopCount, count_flops
from src.lm.options import Adapters
from src.utils.config import ConfigError

log = logging.getLogger(__name__)


def choose(adapters: Adapters) -> tuple[Optional[dict[str, Any]], Any, Any]:
    """(model.lora's options without `enabled`, None when off; model/peft's config; model.freeze checked:
    src/lm/features/frozen.py), one sentence where both adapters are set or one is with model.freeze."""
    lora, peft, freeze = dict(adapters.lora or {}), adapters.peft, adapters.freeze
    enabled = bool(lora.pop("enabled", False))
    if enabled and peft is not None:
        raise ConfigError("Set either model.lora.enabled=true or model/peft=..., not both.")
    return (lora if enabled else None), peft, frozen.check(freeze, enabled or peft is not None)


def add(
    model: torch.nn.Module, lora: Optional[dict[str, Any]], peft: Any, seq_len: int, added: list[str]
) -> tuple[Any, Any]:
    """(the model with its adapter, the peft config; the model unchanged and None without one). `added`: what the
    objective added to the model (a reward head), which trains with the adapter."""
    if lora is not None:
        peft = hf.lora_config(**lora, model=model)
    if peft is None:
        return model, None
    if isinstance(peft, bottleneck.BottleneckConfig):  # the model keeps it as `bottleneck_config` (export-hf)
        model = bottleneck.add(model, peft)
        for name in added:
            model.get_parameter(name).requires_grad_(True)
        log_counts(model, "bottleneck adapters")
        return model, peft
    from peft import get_peft_model

    virtual = getattr(peft, "num_virtual_tokens", 0) or 0  # prompt tuning prepends these to the input
    if virtual and seq_len + virtual > hf.context_length(model.config):
        raise ConfigError(
            f"data.seq_len={seq_len} + {virtual} virtual tokens exceed the model's context of "
            f"{hf.context_length(model.config)}; lower data.seq_len."
        )
    model = get_peft_model(model, peft)
    for name in added:
        model.get_base_model().get_parameter(name).requires_grad_(True)
    log_counts(model, type(peft).__name__)
    return model, peft


def is_peft(peft: Any) -> bool:
    """A config of the peft library (its model can disable its adapter: a DPO reference without a copy)."""
    return peft is not None and not isinstance(peft, bottleneck.BottleneckConfig)


def log_counts(model: torch.nn.Module, what: str) -> None:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    log.info(f"{what}: {trainable:,} trainable and {frozen:,} frozen parameters")


def flops_of(model: torch.nn.Module, peft: Any) -> FlopCount:
    """FLOPs per token, counted before a strategy shards the parameters (a ZeRO-3 parameter has numel 0)."""
    base = model.get_base_model() if is_peft(peft) else model
    inside = {id(p) for p in base.parameters()}
    prompt = any(p.requires_grad and id(p) not in inside for p in model.parameters())  # peft prompt / prefix
    prepended = type(peft).__name__ in ("PromptTuningConfig", "PromptEncoderConfig")  # prompt tuning, P-tuning
    virtual = peft.num_virtual_tokens if prepended else 0
    return count_flops(base, hf.decoder_layers(base), prompt, virtual)
