"""GPT-2 language model as a LightningModule: `transformers.GPT2LMHeadModel` from a `GPT2Config`,
or pretrained weights; optionally with LoRA or another peft adapter, and gradient checkpointing."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from torchmetrics import Metric
from transformers import GPT2Config, GPT2LMHeadModel

from src.models.base import LitModule
from src.utils.config import ConfigError, check_int

IGNORE_INDEX = -100
log = logging.getLogger(__name__)


def load_pretrained(name_or_path: str, attn_implementation: str = "sdpa") -> GPT2LMHeadModel:
    try:
        return GPT2LMHeadModel.from_pretrained(name_or_path, attn_implementation=attn_implementation)
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"model.pretrained={name_or_path!r} could not be loaded ({first}). Pass a local dir with "
                          "config.json + model.safetensors, or a hub name such as gpt2 when online.") from e


def lora_config(r: int, alpha: int, dropout: float, target_modules: list[str]):
    from peft import LoraConfig

    # GPT-2's projections are transformers Conv1D layers, whose weights are stored transposed.
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                      fan_in_fan_out=True, task_type="CAUSAL_LM")


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the token cross-entropies, number of targets), in fp32.

    Labels are already shifted, the convention of all data here: labels[t] is the target of
    position t (the token after input t), -100 where there is none. A batch with no target gives
    exactly (0, 0), never NaN, so it can be added to any sum; a NaN logit still gives NaN.
    """
    logits = logits[:, -labels.shape[1] :]  # prompt tuning prepends virtual tokens to the logits
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                             ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (labels != IGNORE_INDEX).sum()


class TokenMeanLoss(Metric):
    """Σ token losses / Σ targets over all ranks: torchmetrics all-gathers the two sums, not a mean of
    means. Unlike MeanMetric it never drops NaNs (a diverged model must show NaN), and batches
    without targets add exactly 0 to both sums."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("loss_sum", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("n_targets", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, loss_sum: torch.Tensor, n_targets: torch.Tensor) -> None:
        self.loss_sum += loss_sum.detach().float()
        self.n_targets += n_targets

    def compute(self) -> torch.Tensor:
        return self.loss_sum / self.n_targets


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
        pretrained: Optional[str] = None,
        gradient_checkpointing: bool = False,
        lora: Optional[dict[str, Any]] = None,
        peft: Optional[Any] = None,
        compile: bool = False,
        attn_implementation: str = "sdpa",
        activation_function: str = "gelu_pytorch_tanh",
    ) -> None:
        for key, value in (("model.n_layer", n_layer), ("model.n_head", n_head), ("model.n_embd", n_embd)):
            check_int(key, value)
        if not pretrained and n_embd % n_head:
            raise ConfigError(f"model.n_embd={n_embd} does not divide into model.n_head={n_head} heads: pick "
                              "n_embd as a multiple of n_head.")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ConfigError(f"model.dropout={dropout!r} is not valid: use a probability in [0, 1).")
        super().__init__(optimizer, scheduler, weight_decay, lr_scaling, base_batch_size)
        if pretrained:  # the checkpoint's shape wins over n_layer / n_head / n_embd
            model = load_pretrained(pretrained, attn_implementation)
            if seq_len > model.config.n_positions:
                raise ConfigError(f"data.seq_len={seq_len} exceeds {pretrained}'s context of {model.config.n_positions}.")
            if vocab_size < model.config.vocab_size:
                raise ConfigError(f"The tokenizer has {vocab_size} tokens but {pretrained} was trained with "
                                  f"{model.config.vocab_size}: use its own tokenizer (data.tokenizer={pretrained}).")
            if vocab_size > model.config.vocab_size:  # special tokens added to the tokenizer
                log.info(f"Resizing the embeddings from {model.config.vocab_size} to {vocab_size} tokens")
                model.resize_token_embeddings(vocab_size)
        else:
            model = GPT2LMHeadModel(GPT2Config(
                vocab_size=vocab_size, n_positions=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1,
                attn_implementation=attn_implementation, activation_function=activation_function,
            ))
        model.loss_type = "ForCausalLM"  # what transformers falls back to anyway, minus its warning
        self.config = model.config
        self.seq_len = seq_len
        self.n_params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
        if gradient_checkpointing:  # recompute each block's activations in backward: less memory, more compute
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lora = dict(lora or {})
        if lora.pop("enabled", False):
            if peft is not None:
                raise ConfigError("Set either model.lora.enabled=true or model/peft=..., not both.")
            peft = lora_config(**lora)
        if peft is not None:  # only the adapter trains; the base weights are frozen
            from peft import get_peft_model

            virtual = getattr(peft, "num_virtual_tokens", 0) or 0  # prompt tuning prepends these to the input
            if virtual and seq_len + virtual > model.config.n_positions:
                raise ConfigError(f"data.seq_len={seq_len} + {virtual} virtual tokens exceed the model's context of "
                                 f"{model.config.n_positions}; lower data.seq_len.")

            model = get_peft_model(model, peft)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
            log.info(f"{type(peft).__name__}: {trainable:,} trainable and {frozen:,} frozen parameters")
        if compile:  # in place: parameter names (and so checkpoints) stay those of the plain model
            model.compile()
        self.model = model
        self.val_metrics = torch.nn.ModuleDict({"loss": TokenMeanLoss()})
        self.test_metrics = torch.nn.ModuleDict({"loss": TokenMeanLoss()})

    @property
    def hf_model(self) -> GPT2LMHeadModel:
        """The GPT2LMHeadModel itself, also when a peft adapter wraps it."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def network(self) -> torch.nn.Module:
        return self.model

    def blocks(self) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
        layers = self.hf_model.transformer.h
        return [(layers, str(i), block) for i, block in enumerate(layers)]

    @property
    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6N for forward+backward matmuls plus attention (PaLM, appendix B)."""
        c = self.config
        return 6 * self.n_params + 12 * c.n_layer * c.n_embd * self.seq_len

    @property
    def flops_per_batch(self) -> float:
        """Read by Lightning's ThroughputMonitor to log FLOP/s and MFU."""
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        if datamodule is None or not getattr(datamodule, "batch_size", None):
            return 0.0
        return float(self.flops_per_token * datamodule.batch_size * self.seq_len)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None):
        """The model's output; with `labels` (already shifted, see summed_token_loss) its `.loss` is their
        token mean. Training normalises differently: by the whole optimizer step's targets."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask)
        if labels is not None:
            loss_sum, n_targets = summed_token_loss(out.logits, labels)
            out.loss = loss_sum / n_targets
        return out

    def _loss_and_count(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the batch's token losses, number of targets)."""
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
        return summed_token_loss(logits, batch["labels"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.token_mean_loss(*self._loss_and_count(batch), batch_idx)
        self.log_train_loss(loss, batch_idx)
        return self.loss_for_backward(loss)

    def train_metrics(self, loss: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"train/loss": loss, "train/ppl": torch.exp(loss)}

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.val_metrics["loss"].update(*self._loss_and_count(batch))

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.test_metrics["loss"].update(*self._loss_and_count(batch))

    def _log_epoch(self, stage: str, metrics: torch.nn.ModuleDict) -> None:
        loss = self.log_epoch_metrics(stage, metrics)[f"{stage}/loss"]
        self.log(f"{stage}/ppl", torch.exp(loss), prog_bar=stage == "val")

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val", self.val_metrics)

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test", self.test_metrics)
