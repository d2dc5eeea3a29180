"""What the pipeline and tensor-parallel strategies need of a model beyond LitModule's blocks(), networks() and
wrappers(): `ParallelLM`, which src/lm/models/causal_lm.py's CausalLMLitModule implements. src/parallel reads nothing
else of the module it splits (tests/test_layers.py reads its uses with ast); the strategies' check_config refuses a
model without it before any rank starts (`implemented_by`)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class StageObjective(Protocol):
    """What the pipeline's last stage asks the module's objective (src/lm/objectives/base.py): a micro-batch's loss is
    its `loss_sum`, the step's normaliser the batch's `n_targets`, and evaluation adds (loss, count) with `add_sums`."""

    val_metrics: nn.ModuleDict
    test_metrics: nn.ModuleDict

    def loss_sum(self, module: Any, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor: ...

    def n_targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def add_sums(self, metrics: nn.ModuleDict, loss: torch.Tensor, count: torch.Tensor) -> None: ...


@runtime_checkable
class ParallelLM(Protocol):
    """A transformers decoder LM as the pipeline and tensor-parallel strategies split it: these members, and no
    other member of the module but LitModule's (src/core/module.py)."""

    objective: StageObjective
    router_balance: Optional[Callable]  # a MoE model's load-balancing loss, carried through the stages; else None
    attn_implementation: str  # "eager": the pipeline's stages run the model's eager attention
    seq_len: int  # the context a whole compiled model's attention is probed at (compiled_attention.py)

    @property
    def hf_model(self) -> nn.Module: ...  # the transformers model split (its config, its layers, its embeddings)


CLASS_MEMBERS = ("hf_model",)  # what the module's class shows; the others its __init__ sets


def implemented_by(model: Any) -> bool:
    """Whether `model` (the config's `model` node) builds a ParallelLM: a node without a `_target_` is taken to."""
    from hydra.utils import get_object

    target = model.get("_target_") if hasattr(model, "get") else None
    if not target:
        return True
    cls = get_object(target)
    return isinstance(cls, type) and all(hasattr(cls, name) for name in CLASS_MEMBERS)
