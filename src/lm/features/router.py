"""The LM module's model.router_aux_loss: a mixture-of-experts model's router load-balancing loss trained with the
objective's (src/lm/objectives/moe.py computes it per sequence), the refusal of an objective that does not add it, and
the probe that the model's forward returns its router logits, run before step 1 where each rank runs the whole model."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from src.core.probe import probing
from src.lm.objectives import moe
from src.lm.objectives.base import Objective
from src.parallel import capabilities, expert_parallel
from src.utils.config import ArchitectureRefused, ConfigError


def balance_loss(enabled: bool, hf_model: nn.Module) -> Optional[Callable]:
    """The model's load-balancing loss function when it has one and model.router_aux_loss is on (read before a
    strategy wraps the model's class); None otherwise."""
    return moe.balance_loss_function(hf_model) if enabled else None


def check_objective(fn: Optional[Callable], objective: Objective, hf_model: nn.Module) -> None:
    """One sentence for an objective that would not add the model's router loss."""
    if fn is not None and not objective.adds_router_loss:
        raise ConfigError(
            f"model/objective={objective.name} does not add {type(hf_model).__name__}'s router "
            f"load-balancing loss: set model.router_aux_loss=false to train the {objective.name} loss alone."
        )


def check_router_logits(module: Any) -> None:
    """An MoE model whose load-balancing loss is trained returns its router logits from a forward with
    output_router_logits=True, or one sentence (flint's forward fails so at a small size, inside transformers' own
    loss). Only where each rank runs the whole model (`keys_dropout`: no stages, no tensor split)."""
    if module.router_balance is None or not capabilities.of(module.trainer.strategy).keys_dropout:
        return
    ids = torch.zeros(1, 8, dtype=torch.long, device=module.device)
    try:
        with probing(module):
            logits = module.lm_forward({"input_ids": ids}, output_router_logits=True).router_logits
        problem = None if logits else "returns no router logits"
    except Exception as error:  # noqa: BLE001 - any failure of that forward is the refusal, said
        problem = f"fails ({type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:160]})"
    if problem:
        raise ArchitectureRefused(
            f"{type(module.hf_model).__name__}'s forward with output_router_logits=True {problem}, and its router "
            "load-balancing loss reads them: set model.router_aux_loss=false."
        )


def clip_over_meshes(module: Any, optimizer: Any, max_norm: Optional[float]) -> bool:
    """Gradient clipping where experts sit on their own ranks (expert parallel): gradients on several meshes, whose
    norms torch's clip cannot stack, clipped by src/parallel/expert_parallel.py; False (nothing done) elsewhere."""
    if not (max_norm and capabilities.of(module.trainer.strategy).grads_on_several_meshes):
        return False
    expert_parallel.clip_grad_norm([p for group in optimizer.param_groups for p in group["params"]], max_norm)
    return True
