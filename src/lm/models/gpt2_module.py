"""GPT-2 (`model=gpt2`, the default): the generic causal LM (src/lm/models/causal_lm.py) with GPT-2's shape keys
(n_layer, n_head, n_embd, dropout, activation_function) and its own initialisation scale (GPT-2's adapter,
src/architectures/gpt2_adapter.py, says the rest the template knows of GPT-2)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from transformers import PretrainedConfig

from src.architectures.gpt2_adapter import GPT2
from src.lm import init
from src.lm.models.causal_lm import CausalLMLitModule
from src.lm.models.spec import ModelSpec
from src.utils.config import ConfigError, check_int


class GPT2Spec(ModelSpec):
    """GPT-2's own initialisation scale, and a pretrained model that is GPT-2."""

    def check_pretrained(self, config: PretrainedConfig) -> PretrainedConfig:
        if config.model_type != GPT2.model_type:
            raise ConfigError(
                f"model.pretrained={self.pretrained!r} is a {config.model_type!r} model and model=gpt2 "
                f"builds GPT-2: use model=causal_lm model.pretrained={self.pretrained}."
            )
        return super().check_pretrained(config)

    def fill(self, model: torch.nn.Module) -> init.Fill:
        return GPT2.fill(model.config)


class GPT2LitModule(CausalLMLitModule):
    """GPT-2's shape keys; every other option is CausalLMLitModule's (typed there once: src/utils/config.py checks a
    `model.*` key against both signatures). `model.config` may set any other GPT2Config field; `model.model_type`
    stays gpt2."""

    spec_type = GPT2Spec

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: Optional[float] = 0.0,
        activation_function: str = "gelu",
        model_type: str = "gpt2",
        config: Optional[dict[str, Any]] = None,
        **options: Any,
    ) -> None:
        for key, value in (("model.n_layer", n_layer), ("model.n_head", n_head), ("model.n_embd", n_embd)):
            check_int(key, value)
        if model_type != GPT2.model_type:
            raise ConfigError(
                f"model.model_type={model_type!r} with model=gpt2: pick the architecture with "
                f"model={model_type} (or model=causal_lm model.model_type={model_type})."
            )
        if not options.get("pretrained") and n_embd % n_head:
            raise ConfigError(
                f"model.n_embd={n_embd} does not divide into model.n_head={n_head} heads: pick "
                "n_embd as a multiple of n_head."
            )
        config = {
            "n_layer": n_layer,
            "n_head": n_head,
            "n_embd": n_embd,
            "activation_function": activation_function,
            **(config or {}),
        }
        super().__init__(
            vocab_size=vocab_size, seq_len=seq_len, model_type="gpt2", config=config, dropout=dropout, **options
        )
