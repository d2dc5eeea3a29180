"""The transformers config a `model:` node will build, read without weights or a model: what the checks that run
before any rank starts (tensor-parallel head counts, pipeline layer counts) need to know of the architecture."""

from __future__ import annotations

from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from src.architectures import adapter_for


def architecture(model: DictConfig) -> Optional[Any]:
    """The PretrainedConfig of `cfg.model`: a pretrained dir's config.json, or `model_type` + `config` fields;
    None for a model that is not a transformers LM (model=convnet) or a config that cannot be read (the model's
    own construction then says why, in one sentence)."""
    from transformers import AutoConfig

    pretrained, model_type = model.get("pretrained"), model.get("model_type")
    try:
        if pretrained:
            return AutoConfig.from_pretrained(pretrained)
        if model_type:
            fields = dict(model.get("config") or {})
            fields = OmegaConf.to_container(OmegaConf.create(fields), resolve=True)
            adapter = adapter_for(model_type)  # model=gpt2's top-level n_layer, n_head, n_embd
            fields.update({key: model[key] for key in (adapter.shape_keys if adapter else ()) if key in model})
            return AutoConfig.for_model(model_type, **fields)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None


def head_counts(config: Any) -> tuple[int, int, int]:
    """(query heads, key/value heads, hidden size) of any decoder config (GPT-2's n_head, n_embd included)."""
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads, config.hidden_size
