"""Any transformers sequence classifier (`AutoModelForSequenceClassification`: BERT, RoBERTa, DistilBERT, ...) on
LitModule, the field's most common fine-tune: built from a config (`config`, with its `model_type`) or loaded from a
pretrained dir (`pretrained`), its labels from the data; `dropout` sets every dropout probability of either.

The module is the worked example of docs/your-model.md with a Hugging Face model inside: the step's mean loss through
the base class, torchmetrics for evaluation, `blocks()` the encoder's layers (FSDP2's units), and `self.model` the
transformers model, which `python -m src.tools.checkpoints export-hf CKPT DIR` writes with save_pretrained (config,
id2label, and the data's tokenizer) for `AutoModelForSequenceClassification.from_pretrained(DIR)`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from src.core import dropout as keyed
from src.core.module import LitModule
from src.utils.config import ConfigError


def build(
    labels: list[str],
    vocab_size: int,
    pad_token_id: int,
    config: Optional[dict],
    pretrained: Optional[str],
    dropout: Optional[float],
    **kw: Any,
) -> nn.Module:
    """The classifier, with num_labels, id2label and label2id from `labels` and every dropout probability `dropout`
    (None: the config's own); a built one gets the data's vocabulary size and padding id, a loaded one must hold the
    data's vocabulary (its head is new where its labels differ)."""
    from omegaconf import DictConfig, OmegaConf
    from transformers import AutoConfig, AutoModelForSequenceClassification

    fields = OmegaConf.to_container(config) if isinstance(config, DictConfig) else dict(config or {})
    names = {"num_labels": len(labels), "id2label": dict(enumerate(labels))}
    names["label2id"] = {name: i for i, name in enumerate(labels)}
    if pretrained and fields:
        raise ConfigError(
            f"model.pretrained={pretrained!r} and model.config both say what to build: set model.config=null to load "
            "the pretrained dir (its dropouts: model.dropout), or model.pretrained=null to build model.config."
        )
    if pretrained:
        hf_config = keyed.set_probability(AutoConfig.from_pretrained(pretrained, **names), dropout)
        if hf_config.vocab_size < vocab_size:
            raise ConfigError(
                f"model.pretrained={pretrained!r} has {hf_config.vocab_size} token ids and the data's tokenizer "
                f"{vocab_size}: set data.tokenizer to the model's own tokenizer dir."
            )
        return AutoModelForSequenceClassification.from_pretrained(
            pretrained, config=hf_config, ignore_mismatched_sizes=True, **kw
        )
    if "model_type" not in fields:
        raise ConfigError("model.config needs a model_type (e.g. bert, roberta, distilbert), or set model.pretrained.")
    model_type = fields.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **fields, vocab_size=vocab_size, pad_token_id=pad_token_id, **names)
    return AutoModelForSequenceClassification.from_config(keyed.set_probability(hf_config, dropout), **kw)


class SequenceClassifierLitModule(LitModule):
    def __init__(
        self,
        labels: list[str],
        vocab_size: int,
        pad_token_id: int = 0,
        config: Optional[dict[str, Any]] = None,
        pretrained: Optional[str] = None,
        dropout: Optional[float] = None,
        attn_implementation: Optional[str] = None,
        optimizer: Optional[Callable[..., torch.optim.Optimizer]] = None,
        scheduler: Optional[Callable[..., Any]] = None,
        weight_decay: float = 0.0,
        lr_scaling: str = "none",
        base_batch_size: int = 32,
    ) -> None:
        super().__init__(optimizer, scheduler, weight_decay, lr_scaling, base_batch_size)
        kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
        self.model = build(list(labels), vocab_size, pad_token_id, config, pretrained, dropout, **kw)

        def metrics() -> nn.ModuleDict:  # a loss weighted by each batch's rows, and the accuracy
            return nn.ModuleDict({"loss": MeanMetric(), "acc": MulticlassAccuracy(len(labels), average="micro")})

        self.val_metrics, self.test_metrics = metrics(), metrics()

    def blocks(self) -> list[tuple[nn.Module, str, nn.Module]]:
        """The encoder's layers, for any family: the base model's longest nn.ModuleList (BERT's encoder.layer,
        DistilBERT's transformer.layer)."""
        lists = [m for m in self.model.base_model.modules() if isinstance(m, nn.ModuleList)]
        if not lists:
            return []
        layers = max(lists, key=len)
        return [(layers, str(i), block) for i, block in enumerate(layers)]

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self(batch).float(), batch["labels"])
        self.log_train_loss(loss, batch_idx)
        return self.loss_for_backward(loss)

    def evaluate(self, batch: dict[str, torch.Tensor], metrics: nn.ModuleDict) -> None:
        logits, labels = self(batch).float(), batch["labels"]
        metrics["loss"].update(nn.functional.cross_entropy(logits, labels), weight=len(labels))
        metrics["acc"].update(logits, labels)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.evaluate(batch, self.val_metrics)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.evaluate(batch, self.test_metrics)

    def on_validation_epoch_end(self) -> None:
        self.log_epoch_metrics("val", self.val_metrics)

    def on_test_epoch_end(self) -> None:
        self.log_epoch_metrics("test", self.test_metrics)
