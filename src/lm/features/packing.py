"""The LM module's side of data.packing=true (src/lm/data/packing.py packs records into one row, told apart by
their position ids, with no attention mask): before step 1, on every rank alike, the probe that the model keeps packed
records apart, and the refusal of a router loss, which is taken per row."""

from __future__ import annotations

from typing import Any

import torch

from src.core.probe import gap_beyond_rounding, probing
from src.utils.config import ConfigError


def check_packing(module: Any) -> None:
    """Two random records packed in one row give the logits each gives alone, or one sentence (a model whose forward
    ignores the position ids' boundaries would let packed conversations see each other)."""
    if module.router_balance is not None:
        raise ConfigError(
            "data.packing=true and a mixture-of-experts router loss: the load-balancing loss is taken per row, "
            "which would mix packed conversations; set model.router_aux_loss=false or data.packing=false."
        )
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, module.vocab_size, (1, n), generator=generator).to(module.device) for n in (6, 5))
    positions = torch.cat([torch.arange(6), torch.arange(5)])[None].to(module.device)
    with probing(module):
        packed = module.lm_forward({"input_ids": torch.cat([a, b], 1), "position_ids": positions}).logits.float()
        alone = torch.cat([module.lm_forward({"input_ids": x}).logits.float() for x in (a, b)], 1)
    fp32 = next(module.model.parameters()).dtype == torch.float32
    gap = gap_beyond_rounding(packed, alone, fp32)
    if gap is not None:
        raise ConfigError(
            f"data.packing=true: {module.config.model_type}'s forward ({module.attn_implementation} attention) lets "
            f"packed conversations see each other (packed logits {gap:.3g} apart from each alone): set "
            "data.packing=false, or another model.attn_implementation."
        )
