"""The LM module's options in typed groups, each built by keyword from the flat `model.*` keys the config sets
(conf/model/causal_lm.yaml: `model.compile=...`, `model.loss_chunk=...` stay as they are) and handed to the part
that owns it: what the model is (ModelSpec), its vocabulary (the spec, padded_vocab.py), compiling (compiling.py),
its adapters (peft_adapters.py, frozen.py), and what its loss computes (chunked_loss.py, router.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from src.utils.config import ConfigError


@dataclass(frozen=True)
class Architecture:
    """What the model is: a transformers model type with config fields (`model.config`), or a pretrained one."""

    model_type: Optional[str] = None
    fields: Any = None  # model.config
    pretrained: Optional[str] = None
    attn_implementation: str = "auto"
    fastest_attention: str = "sdpa"  # what `auto` picks on this machine
    size_for: Optional[str] = None  # the architecture a model/size preset is for
    dropout: Optional[float] = None  # model.dropout: every dropout probability of the architecture

    def __post_init__(self) -> None:
        """One sentence for a model named twice or not at all (model.dropout is checked where the spec takes it)."""
        if self.size_for and not self.pretrained and self.size_for != self.model_type:  # conf/model/size/
            raise ConfigError(
                f"The model/size preset is a {self.size_for} shape and this is model={self.model_type}: use "
                f"model={self.size_for} with it, or a {self.model_type} size (conf/model/size/)."
            )
        if not self.pretrained and not self.model_type:
            raise ConfigError(
                "model.model_type is not set: name an architecture (model=llama, model=qwen2, ...) "
                "or load one with model.pretrained=DIR_OR_HUB_NAME."
            )


@dataclass(frozen=True)
class Vocabulary:
    """The tokenizer's vocabulary (`size`, from data.tokenizer), and what the model's embedding makes of it."""

    size: int
    tokenizer: Optional[str] = None  # its name, read for new rows' initial values
    resize_embeddings: bool = False  # a pretrained model's embedding grown to the tokenizer's rows
    pad_multiple: Optional[int] = None  # model.pad_vocab_multiple: the rows rounded up to a multiple of it


@dataclass(frozen=True)
class Compile:
    """torch.compile and activation checkpointing (src/lm/features/compiling.py)."""

    compile: Any = False  # model.compile: true | blocks | false | auto
    mode: Optional[str] = None  # model.compile_mode
    loss: Any = "auto"  # model.compile_loss
    gradient_checkpointing: bool = False


@dataclass(frozen=True)
class Adapters:
    """What trains of the model: model.lora, model/peft, model.freeze (src/lm/features/peft_adapters.py)."""

    lora: Optional[dict[str, Any]] = None
    peft: Any = None
    freeze: Any = None


@dataclass(frozen=True)
class Loss:
    """How the token loss is computed: model.loss_chunk (chunked_loss.py), model.router_aux_loss (router.py)."""

    chunk: Optional[int] = None
    router_aux_loss: bool = True
