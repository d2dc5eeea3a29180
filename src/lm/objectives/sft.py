"""Next-token prediction on the data's targets (`model/objective=sft`, the default): pretraining on packed text and
supervised fine-tuning on instructions and chats alike, the loss the mean over the optimizer step's target tokens;
an MoE model adds its router's load-balancing loss (src/lm/objectives/moe.py). Metrics: loss and perplexity."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from src.core.metrics import epoch_values
from src.lm.objectives import moe
from src.lm.objectives.base import Objective, TrainedModule
from src.lm.objectives.loss import TokenMeanLoss
from src.utils.config import ConfigError
from src.utils.labels import IGNORE_INDEX


class SFT(Objective):
    name = "sft"
    refused_under: tuple[str, ...] = ()  # the pipeline's last stage computes it (loss_sum, n_targets)
    adds_router_loss = True
    trains_token_loss = True

    def __init__(self) -> None:
        super().__init__()
        self.val_metrics = nn.ModuleDict({"loss": TokenMeanLoss()})
        self.test_metrics = nn.ModuleDict({"loss": TokenMeanLoss()})

    def training_step(self, module: TrainedModule, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if module.router_balance is not None:
            return self._balanced_step(module, batch, batch_idx)
        loss = module.token_mean_loss(*module.loss_and_count(batch), batch_idx)
        module.log_train_loss(loss, batch_idx)
        return loss

    def _balanced_step(self, module: TrainedModule, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """An MoE model's step: the token loss plus router_aux_loss_coef x the mean over the step's sequences of
        each one's load-balancing loss (src/lm/objectives/moe.py); logged: train/aux_loss (that mean) and
        train/expert_load_max (the busiest expert's routed tokens over the experts' mean: 1 is even)."""
        out, loss_sum, n_targets = module.forward_loss(batch, output_router_logits=True)
        loss = module.token_mean_loss(loss_sum, n_targets, batch_idx)
        hf_model, n = module.hf_model, batch["input_ids"].shape[0]
        balance, counts = moe.sequence_balance(
            module.router_balance, out.router_logits, batch.get("attention_mask"), n, hf_model.num_experts,
            hf_model.num_experts_per_tok,
        )  # fmt: skip
        module.log_train_loss(loss, batch_idx, torch.cat([balance.detach()[None], counts, counts.new_tensor([n])]))
        aux = module.sequence_mean_loss(balance, n, batch_idx)
        return loss + hf_model.router_aux_loss_coef * aux

    def train_metrics(self, loss: torch.Tensor, sums: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        metrics = {"train/loss": loss, "train/ppl": torch.exp(loss)}
        if sums is not None:  # an MoE model's: [load-balancing loss sum, tokens per expert..., sequences]
            counts = sums[1:-1]
            metrics.update(
                {"train/aux_loss": sums[0] / sums[-1], "train/expert_load_max": counts.max() / counts.mean()}
            )
        return metrics

    def evaluation_step(self, module: TrainedModule, batch: dict[str, torch.Tensor], metrics: nn.ModuleDict) -> None:
        self.add_sums(metrics, *module.loss_and_count(batch))

    def loss_sum(self, module: TrainedModule, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed token cross-entropy of the labels' targets (module.token_loss)."""
        return module.token_loss(logits, labels)[0]

    def n_targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The labelled tokens: every label but IGNORE_INDEX."""
        return (batch["labels"] != IGNORE_INDEX).sum()

    def add_sums(self, metrics: nn.ModuleDict, loss_sum: torch.Tensor, n_targets: torch.Tensor) -> None:
        metrics["loss"].update(loss_sum, n_targets)

    def epoch_metrics(self, stage: str, metrics: nn.ModuleDict) -> dict[str, torch.Tensor]:
        values = epoch_values(stage, metrics)
        return {**values, f"{stage}/ppl": torch.exp(values[f"{stage}/loss"])}


def chosen(objective: Any) -> Objective:
    """model/objective's choice (SFT when none), or one sentence."""
    if objective is not None and not isinstance(objective, Objective):  # model.objective=dpo: a string
        raise ConfigError(
            f"model.objective={objective!r} is not an objective: choose one with model/objective=sft|dpo|reward|grpo "
            "(conf/model/objective/) and set its options as model.objective.<option>."
        )
    return SFT() if objective is None else objective
