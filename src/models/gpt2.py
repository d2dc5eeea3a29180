"""GPT-2 language model as a LightningModule: `transformers.GPT2LMHeadModel` from a `GPT2Config`."""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Optional

import lightning as L
import torch
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torchmetrics import MeanMetric
from transformers import GPT2Config, GPT2LMHeadModel

IGNORE_INDEX = -100

# Our epoch metrics come from torchmetrics and are already reduced over all ranks; Lightning cannot
# know that and suggests sync_dist=True, which would reduce them a second time.
warnings.filterwarnings("ignore", message=r".*self\.log\('(val|test)/", category=PossibleUserWarning)


class GPT2LitModule(L.LightningModule):
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
    ) -> None:
        super().__init__()
        self.config = GPT2Config(
            vocab_size=vocab_size, n_positions=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
            bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1,
            attn_implementation="sdpa",  # torch's fused scaled_dot_product_attention
        )
        self.model = GPT2LMHeadModel(self.config)
        self.model.loss_type = "ForCausalLM"  # what transformers falls back to anyway, minus its warning
        self.optimizer_fn, self.scheduler_fn, self.weight_decay = optimizer, scheduler, weight_decay
        # Token-weighted means that torchmetrics syncs across ranks (sum and count, not a mean of means).
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self.n_params = sum(p.numel() for p in self.model.parameters())  # tied embeddings counted once

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
        self.log_dict({"train/loss": loss, "train/ppl": torch.exp(loss.detach())}, on_step=True, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, n = self._loss_and_count(batch)
        self.val_loss.update(loss, weight=n)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, n = self._loss_and_count(batch)
        self.test_loss.update(loss, weight=n)

    def _log_epoch(self, stage: str, metric: MeanMetric) -> None:
        loss = metric.compute()  # all-reduces sum and weight across ranks
        self.log_dict({f"{stage}/loss": loss, f"{stage}/ppl": torch.exp(loss)}, prog_bar=stage == "val")
        metric.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val", self.val_loss)

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test", self.test_loss)

    def configure_optimizers(self) -> Any:
        if self.optimizer_fn is None:
            raise ValueError("model.optimizer is not set; see conf/model/gpt2.yaml.")
        # Weight decay on matrices only: biases and LayerNorm gains are not decayed (as in GPT-2/nanoGPT).
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.weight_decay, "name": "decay"},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "name": "no_decay"},
        ]
        optimizer = self.optimizer_fn(groups)
        if self.scheduler_fn is None:
            return optimizer
        steps = self.trainer.estimated_stepping_batches
        if not math.isfinite(steps):
            raise ValueError("The LR schedule needs a finite length: set trainer.max_steps (or trainer.max_epochs).")
        scheduler = self.scheduler_fn(optimizer, num_training_steps=int(steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
