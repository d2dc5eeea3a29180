"""GPT-2 language model as a LightningModule: `transformers.GPT2LMHeadModel` from a `GPT2Config`."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torchmetrics import MeanMetric
from transformers import GPT2Config, GPT2LMHeadModel

from src.models.base import LitModule

IGNORE_INDEX = -100


class GPT2LitModule(LitModule):
    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        optimizer: Optional[Callable[..., torch.optim.Optimizer]] = None,
        scheduler: Optional[Callable[..., Any]] = None,
        weight_decay: float = 0.1,
        lr_scaling: str = "none",
        base_batch_size: int = 32,
    ) -> None:
        super().__init__(optimizer, scheduler, weight_decay, lr_scaling, base_batch_size)
        self.config = GPT2Config(
            vocab_size=vocab_size, n_positions=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
            bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1,
            attn_implementation="sdpa",  # torch's fused scaled_dot_product_attention
        )
        self.model = GPT2LMHeadModel(self.config)
        self.model.loss_type = "ForCausalLM"  # what transformers falls back to anyway, minus its warning
        self.n_params = sum(p.numel() for p in self.model.parameters())  # tied embeddings counted once
        # Token-weighted mean losses: torchmetrics syncs the sum and the weight, not a mean of means.
        self.val_metrics = torch.nn.ModuleDict({"loss": MeanMetric()})
        self.test_metrics = torch.nn.ModuleDict({"loss": MeanMetric()})

    def network(self) -> torch.nn.Module:
        return self.model

    def blocks(self) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
        layers = self.model.transformer.h
        return [(layers, str(i), block) for i, block in enumerate(layers)]

    @property
    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6N for forward+backward matmuls plus attention (PaLM, appendix B)."""
        c = self.config
        return 6 * self.n_params + 12 * c.n_layer * c.n_embd * c.n_positions

    @property
    def flops_per_batch(self) -> float:
        """Read by Lightning's ThroughputMonitor to log FLOP/s and MFU."""
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        if datamodule is None or not getattr(datamodule, "batch_size", None):
            return 0.0
        return float(self.flops_per_token * datamodule.batch_size * self.config.n_positions)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None):
        return self.model(input_ids=input_ids, labels=labels)

    def _loss_and_count(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        loss = self(batch["input_ids"], batch["labels"]).loss
        n_targets = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()  # HF shifts labels by one inside
        return loss, n_targets

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss_and_count(batch)
        self.log_train_loss(loss, batch_idx)
        return loss

    def train_metrics(self, loss: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"train/loss": loss, "train/ppl": torch.exp(loss)}

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, n = self._loss_and_count(batch)
        self.val_metrics["loss"].update(loss, weight=n)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, n = self._loss_and_count(batch)
        self.test_metrics["loss"].update(loss, weight=n)

    def _log_epoch(self, stage: str, metrics: torch.nn.ModuleDict) -> None:
        loss = self.log_epoch_metrics(stage, metrics)[f"{stage}/loss"]
        self.log(f"{stage}/ppl", torch.exp(loss), prog_bar=stage == "val")

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val", self.val_metrics)

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test", self.test_metrics)
