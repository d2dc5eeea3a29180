"""GPT-2 (`model=gpt2`, the default): the generic causal LM (src/models/causal_lm.py) with GPT-2's shape keys
(n_layer, n_head, n_embd, dropout, activation_function) and its own initialisation scale (src/architectures/gpt2.py,
GPT-2's adapter, says the rest the template knows of GPT-2)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from transformers import PretrainedConfig

from src.architectures.gpt2 import GPT2
from src.models import init
from src.models.causal_lm import CausalLMLitModule
from src.objectives.base import Objective
from src.utils.config import ConfigError, check_int


class GPT2LitModule(CausalLMLitModule):
    """`model.config` may set any other GPT2Config field; `model.model_type` stays gpt2. The signature repeats
    CausalLMLitModule's on purpose: src/utils/config.py checks every `model.*` key against it (no **kwargs)."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        activation_function: str = "gelu",
        model_type: str = "gpt2",
        config: Optional[dict[str, Any]] = None,
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
        attn_implementation: str = "auto",
        resize_embeddings: bool = False,
        tokenizer: Optional[str] = None,
        objective: Optional[Objective] = None,
        size_for: Optional[str] = None,
        compile_loss: Any = "auto",
        fastest_attention: str = "sdpa",
        router_aux_loss: bool = True,
    ) -> None:
        for key, value in (("model.n_layer", n_layer), ("model.n_head", n_head), ("model.n_embd", n_embd)):
            check_int(key, value)
        if model_type != GPT2.model_type:
            raise ConfigError(
                f"model.model_type={model_type!r} with model=gpt2: pick the architecture with "
                f"model={model_type} (or model=causal_lm model.model_type={model_type})."
            )
        if not pretrained and n_embd % n_head:
            raise ConfigError(
                f"model.n_embd={n_embd} does not divide into model.n_head={n_head} heads: pick "
                "n_embd as a multiple of n_head."
            )
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ConfigError(f"model.dropout={dropout!r} is not valid: use a probability in [0, 1).")
        config = {
            "n_layer": n_layer,
            "n_head": n_head,
            "n_embd": n_embd,
            "resid_pdrop": dropout,
            "embd_pdrop": dropout,
            "attn_pdrop": dropout,
            "activation_function": activation_function,
            **(config or {}),
        }
        super().__init__(
            vocab_size=vocab_size,
            seq_len=seq_len,
            model_type="gpt2",
            config=config,
            optimizer=optimizer,
            scheduler=scheduler,
            weight_decay=weight_decay,
            lr_scaling=lr_scaling,
            base_batch_size=base_batch_size,
            pretrained=pretrained,
            gradient_checkpointing=gradient_checkpointing,
            lora=lora,
            peft=peft,
            compile=compile,
            attn_implementation=attn_implementation,
            resize_embeddings=resize_embeddings,
            tokenizer=tokenizer,
            objective=objective,
            size_for=size_for,
            compile_loss=compile_loss,
            fastest_attention=fastest_attention,
            router_aux_loss=router_aux_loss,
        )

    def check_pretrained(self, config: PretrainedConfig, seq_len: int) -> PretrainedConfig:
        if config.model_type != GPT2.model_type:
            raise ConfigError(
                f"model.pretrained={self._pretrained!r} is a {config.model_type!r} model and model=gpt2 "
                f"builds GPT-2: use model=causal_lm model.pretrained={self._pretrained}."
            )
        return super().check_pretrained(config, seq_len)

    def fill(self, model: torch.nn.Module) -> init.Fill:
        return GPT2.fill(model.config)
