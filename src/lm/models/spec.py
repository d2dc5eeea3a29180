"""How the LM module's transformers model is built and given its initial values: from a model type and config fields
(the vocabulary from the tokenizer, the context from data.seq_len, unless the fields set them) or from a pretrained
checkpoint, whose shape wins over the fields. Under a sharding strategy (train.py's deferred_init) the model is built
on the meta device and the strategy has each rank materialise its own share (`materialize`), the values the same on
every layout (src/lm/init.py). An architecture with its own rules subclasses ModelSpec (gpt2_module.py)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from src.core import dropout as keyed
from src.lm import hf, init
from src.lm.options import Architecture, Vocabulary
from src.utils.config import ConfigError


class ModelSpec:
    def __init__(
        self, architecture: Architecture, vocabulary: Vocabulary, seq_len: int, rows: int, deferred: bool
    ) -> None:
        """`rows`: the embedding's rows (the vocabulary, padded by model.pad_vocab_multiple); `deferred`: leave the
        model on the meta device for a strategy to materialise."""
        self.vocab_size, self.seq_len, self.model_type = vocabulary.size, seq_len, architecture.model_type
        fields = architecture.fields  # plain lists and dicts: transformers rejects OmegaConf's (e.g. layer_types=[...])
        self.fields = OmegaConf.to_container(fields) if isinstance(fields, DictConfig) else dict(fields or {})
        self.pretrained, self.resize_embeddings = architecture.pretrained, vocabulary.resize_embeddings
        self.tokenizer, self.rows, self.dropout, self.deferred = (
            vocabulary.tokenizer,
            rows,
            architecture.dropout,
            deferred,
        )
        self.base_seed = init.draw_base_seed()  # seeds every parameter's init (src/lm/init.py)
        kind = hf.pretrained_config(self.pretrained).model_type if self.pretrained else self.model_type
        self.attn_implementation = hf.choose_attention(
            kind, architecture.attn_implementation, architecture.fastest_attention
        )
        self._fill: tuple[Optional[str], Any] = (None, None)

    def build(self) -> PreTrainedModel:
        """The model, materialised on the CPU, or on the meta device where deferred (a pretrained one's embeddings
        sized for the tokenizer: rank 0 reads the weights later)."""
        if self.pretrained:
            config = self.set_dropout(
                self.check_pretrained(hf.pretrained_config(self.pretrained, self.attn_implementation))
            )
            if not self.deferred:
                return self.set_dropout(self.load_pretrained(config))
            config.vocab_size = max(self.vocab_size, config.vocab_size)
            return self.set_dropout(hf.build_on_meta(config))
        model = self.set_dropout(hf.build_on_meta(self.set_dropout(self.new_config())))
        if not self.deferred:
            init.materialize_full(model, self.fill(model), self.base_seed, torch.device("cpu"))
        return model

    def set_dropout(self, built: Any) -> Any:
        return keyed.set_probability(built, self.dropout)

    def new_config(self) -> PretrainedConfig:
        """A config built from `model.model_type` and `model.config` (any field of that architecture's config)."""
        fields = {
            "max_position_embeddings": self.seq_len,
            "bos_token_id": self.vocab_size - 1,
            "eos_token_id": self.vocab_size - 1,
            **self.fields,
            "vocab_size": self.rows,  # rows never scored: src/lm/features/padded_vocab.py
        }
        config = hf.new_config(self.model_type, self.attn_implementation, **fields)
        if self.seq_len > hf.context_length(config):
            raise ConfigError(
                f"data.seq_len={self.seq_len} exceeds model.config.max_position_embeddings="
                f"{hf.context_length(config)}: raise it or lower data.seq_len."
            )
        return config

    def check_pretrained(self, config: PretrainedConfig) -> PretrainedConfig:
        """One sentence for a pretrained model that cannot take this data."""
        name, vocab = self.pretrained, self.vocab_size
        if self.seq_len > hf.context_length(config):
            raise ConfigError(f"data.seq_len={self.seq_len} exceeds {name}'s context of {hf.context_length(config)}.")
        if vocab < config.vocab_size:
            raise ConfigError(
                f"The tokenizer has {vocab} tokens but {name} was trained with {config.vocab_size}: use its own "
                f"tokenizer (data.tokenizer={name})."
            )
        if vocab > config.vocab_size and not self.resize_embeddings:
            raise ConfigError(
                f"The tokenizer has {vocab} tokens and {name}'s embeddings {config.vocab_size}: set "
                f"model.resize_embeddings=true to add rows for the new tokens, or use the model's own tokenizer "
                f"(data.tokenizer={name})."
            )
        return config

    def fill(self, model: torch.nn.Module) -> init.Fill:
        """Initial values of a model built from a config (src/lm/init.py): the architecture's own rule
        (hf.architecture_fill); what the architecture does not hold (a reward head) transformers' default rule at
        the config's standard deviation (`initializer_range`; OPT names it `init_std`). One meta copy per config,
        made when the module is made (outside any strategy's context: DeepSpeed's zero.Init would partition it)."""
        config = model.config
        key = config.to_json_string()
        if self._fill[0] != key:
            std = getattr(config, "initializer_range", None) or getattr(config, "init_std", None) or 0.02
            self._fill = (key, hf.architecture_fill(model, hf.standard_fill(model, std)))
        return self._fill[1]

    def load_pretrained(self, config: Optional[PretrainedConfig] = None) -> PreTrainedModel:
        """The whole pretrained model (with `config`, that instead of the checkpoint's: model.dropout), its embeddings
        resized to the tokenizer's vocabulary."""
        model = hf.load_pretrained(self.pretrained, self.attn_implementation, config)
        if self.vocab_size > model.config.vocab_size:  # special tokens added to the tokenizer
            hf.resize_vocab(model, self.vocab_size, self.base_seed, self.tokenizer)
        return model

    def materialize(
        self, networks: list[torch.nn.Module], device: torch.device, sharded: bool, prepare: Callable
    ) -> None:
        """Give meta-device networks (the policy, and a reference: the same starting values) their values: sharded
        (after fully_shard), each rank makes only its shards, one parameter at a time; pretrained weights are read by
        rank 0 alone (`prepare`d as the module prepares its model) and broadcast."""
        state = None
        if self.pretrained and (not sharded or torch.distributed.get_rank() == 0):
            state = prepare(self.load_pretrained()).state_dict()
        for network in networks:
            if self.pretrained and sharded:
                init.load_full_state_sharded(network, state, device)
            elif self.pretrained:
                init.allocate(network, device)
                network.load_state_dict(state)
            elif sharded:
                init.materialize_sharded(network, self.fill(network), self.base_seed, device)
            else:
                init.materialize_full(network, self.fill(network), self.base_seed, device)

    def rebuilt(self, config: PretrainedConfig) -> PreTrainedModel:
        """The model built again from `config`, for DeepSpeed ZeRO-3: Lightning runs configure_model inside
        deepspeed.zero.Init, so each parameter is partitioned as its module is made (filled afterwards, one gathered
        parameter at a time: init.materialize_zero3). transformers' own init would run on the partitioned (empty)
        parameters, which it cannot (OLMoE's and Gemma's padding row: IndexError), so it is skipped, and with it its
        tie_weights: tied here. Buffers keep what the modules' __init__ computes."""
        from transformers.initialization import no_init_weights

        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config)
        model.tie_weights()
        return model
