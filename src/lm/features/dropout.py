"""The LM's keyed dropout (src/core/dropout.py): every dropout of the model keyed per sample (`key_model`), each
training batch's row keys (`keys_of`), and the probe before step 1 (`check_draws`): what no key reaches (a kernel's
own dropout, router jitter) is found there (two training forwards under different generator states must agree) and
refused in one sentence."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from src.core.dropout import (
    PROBABILITY_FIELD,
    KeyedDropout,
    config_fields,
    field_list,
    has_dropout,
    key_attention,
    key_dropouts,
    key_functional_dropouts,
    row_keys,
)
from src.core.probe import gap_beyond_rounding, probing
from src.parallel import capabilities
from src.utils.config import ArchitectureRefused, ConfigError


def key_model(model: nn.Module, attn_implementation: str) -> int:
    """Every dropout of `model` keyed per sample: its dropout modules, and where its config holds a dropout
    probability, its attention's; the number of dropouts with p > 0 (modules or attention)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    functional = 0
    if any(config_fields(base.config).values()):  # the forward may draw dropout itself
        functional = key_attention(base, attn_implementation) + key_functional_dropouts(base)
    return key_dropouts(model) + functional


def keys_of(module: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The dropout keys of the LM module's training batch's rows: the run's seed, the optimizer step and each row's
    sample; one sentence for a batch that does not name its samples."""
    rows = batch["input_ids"].shape[0]
    index = batch.get("sample_index")
    if index is None or rows % index.numel():
        raise ConfigError(
            f"{type(module.hf_model).__name__} has dropout and this batch does not say which sample each row is "
            f"(the data's train loader gives `sample_index`; {module.objective.name}'s rows are its own): "
            "set model.dropout=0."
        )
    # Lightning's global_step: the trainer's, or 0 for a module used on its own
    return row_keys(index.to(batch["input_ids"].device), rows, module.global_step, module.base_seed)


def check_draws(module: Any) -> None:
    """Before step 1, on every rank alike: the LM module's training forward draws nothing from torch's generator (two
    forwards under different generator states give the same logits), or one sentence. Its dropout modules are keyed
    per sample; what a forward draws itself (functional attention dropout, router jitter) would give each layout other
    masks. Under a strategy that splits a row's forward (tensor parallel, pipeline stages: `keys_dropout` false) any
    dropout is refused."""
    fields = {k: v for k, v in config_fields(module.config).items() if v}
    kind = type(module.hf_model).__name__
    if not capabilities.of(module.trainer.strategy).keys_dropout:
        if has_dropout(module.model) or fields:
            raise ArchitectureRefused(
                f"{kind} has dropout ({field_list(fields)}), which {type(module.trainer.strategy).__name__} "
                f"would draw per rank: {_fix(module.model, fields)}."
            )
        return
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, module.vocab_size, (1, 8), generator=generator).to(module.device)
    batch = {"input_ids": ids, "sample_index": torch.zeros(1, dtype=torch.long)}
    gpus = [module.device] if module.device.type == "cuda" else []  # the generators the probe must not advance
    outs = []
    with probing(module, training=True), torch.random.fork_rng(devices=gpus):
        for seed in (1, 2):
            torch.manual_seed(seed)
            outs.append(module.lm_forward(batch).logits.float())
    fp32 = next(module.model.parameters()).dtype == torch.float32
    gap = gap_beyond_rounding(outs[1], outs[0], fp32)
    if gap is not None:
        raise ArchitectureRefused(
            f"{kind}'s training forward draws random numbers of its own ({field_list(fields)}; logits {gap:.3g} apart "
            f"under two generator states), which would differ with the number of devices: {_fix(module.model, fields)}."
        )


def _fix(model: nn.Module, fields: dict[str, float]) -> str:
    """What turns off every random draw named in a refusal: model.dropout, the config's other random fields (router
    jitter: model.config.X), LoRA's dropout."""
    fix = []
    probabilities = [k for k in fields if PROBABILITY_FIELD.search(k)]
    if probabilities or not fields:
        fix.append("model.dropout=0")
    fix += [f"model.config.{k}=0" for k in fields if not PROBABILITY_FIELD.search(k)]
    if any(isinstance(m, KeyedDropout) and m.p > 0 and "lora_" in m.name for m in model.modules()):
        fix.append("model.lora.dropout=0")
    return "set " + " and ".join(fix)
