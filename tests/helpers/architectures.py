"""The causal-LM architectures the installed transformers ships, built at a CPU size from their own config
defaults: what the meta-init, pipeline and matrix tests enumerate (TEST_ALL_ARCHITECTURES=1), and the sample of
families the default suite runs."""

from __future__ import annotations

import os

TINY = {  # a CPU size, where the architecture's config has the key; the rest stay its own defaults
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "pad_token_id": 0,
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_embd": 64,  # GPT-J, CodeGen: GPT-2's names
    "n_head": 4,
    "rotary_dim": 8,
}
# Architectures whose config names its sizes otherwise than TINY, or ties fields together (multi-head latent
# attention needs as many key/value heads as heads; the indexers of DeepSeek-V3.2, GLM-DSA and dots3; Gemma-3n's and
# Gemma-4's per-layer embeddings of their own vocabulary; LongCat's zero experts; dots1's expert count, None by
# default; Gemma-3n's key/value sharing across its last layers, none at 2 layers): the fields that make them a CPU size
_MLA = {"num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16, "v_head_dim": 16, "qk_head_dim": 32, "n_routed_experts": 4, "n_group": 1,
        "topk_group": 1}  # fmt: skip
_MLA_TYPES = ("axk1", "axk2", "beam", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3", "sarvam_mla", "youtu")
FIELDS = {
    **{a: _MLA for a in _MLA_TYPES},
    "deepseek_v32": {**_MLA, "index_head_dim": 32, "index_n_heads": 4},
    # MLA with linear-attention layers (their own head sizes) and experts named otherwise
    "kimi_linear": {**_MLA, "num_experts_per_token": 2, "linear_head_dim": 16, "linear_num_heads": 4},
    "bailing_hybrid": {**_MLA, "num_experts_per_token": 2, "num_expert_group": 1, "topk_group": 1, "head_dim": 16},
    "glm_moe_dsa": {**_MLA, "index_head_dim": 32, "index_n_heads": 4},
    "longcat_flash": {
        **_MLA,
        "ffn_hidden_size": 128,
        "expert_ffn_hidden_size": 32,
        "zero_expert_num": 2,
        "moe_topk": 2,
    },
    "gemma4_text": {"vocab_size_per_layer_input": 300, "hidden_size_per_layer_input": 16},
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2},
    "dots3_note_text": {**_MLA, "index_head_dim": 32, "index_n_heads": 4},
    "gemma3n_text": {"vocab_size_per_layer_input": 300, "hidden_size_per_layer_input": 16, "num_kv_shared_layers": 0},
    # its image and audio encoders (no text-only batch reaches them) at a CPU size
    "phi4_multimodal": {
        "vision_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 56,
            "crop_size": 56,
        },
        "audio_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_blocks": 2,
            "num_attention_heads": 2,
            "ext_pw_out_channel": 32,
            "depthwise_separable_out_channel": 32,
            "nemo_conv_channels": 32,
        },
    },  # fmt: skip
    # its default rope_parameters are empty, and each layer type reads its own
    "cohere_compass_text": {
        "rope_parameters": {
            t: {"rope_type": "default", "rope_theta": 10000.0} for t in ("full_attention", "sliding_attention")
        }
    },  # fmt: skip
}
# one of each thing that differs: q/k norms (Qwen3), fused projections (Phi-3), soft-capping and scaled embeddings
# (Gemma2, Gemma3 with local + global rotary), multipliers (Granite), logit scale + parallel blocks (Cohere),
# partial rotary (GPT-NeoX), experts (Mixtral)
SAMPLE = ["llama", "gemma", "gemma2", "gemma3_text", "qwen3", "granite", "cohere", "phi3", "gpt_neox", "mixtral"]


def with_ep_plan() -> list[str]:
    """Those of `with_both_plans` whose config ships an expert-parallel plan (its experts modules: MoE models)."""
    from transformers import AutoConfig

    return [
        t
        for t in with_both_plans()
        if "ep_dispatch_experts" in (AutoConfig.for_model(t).base_model_ep_plan or {}).values()
    ]


def with_both_plans() -> list[str]:
    """The causal-LM architectures of the installed transformers whose config ships a tp and a pp plan."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = AutoConfig.for_model(model_type)
        except Exception:  # a config that needs arguments: no default to build from
            continue
        if getattr(config, "base_model_tp_plan", None) and getattr(config, "base_model_pp_plan", None):
            types.append(model_type)
    return types


ARCHITECTURES = with_both_plans() if os.environ.get("TEST_ALL_ARCHITECTURES") == "1" else SAMPLE


def tiny_config(model_type: str, layers: int = 2, **fields):
    """`model_type`'s config at TINY's sizes with `layers` layers: each per-layer list of its defaults (layer types,
    which layers are sparse, ...) sampled at evenly spread layers, so that a short model keeps each kind."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type).to_dict()
    n = defaults.get("num_hidden_layers")
    picks = [round(i * (n - 1) / max(layers - 1, 1)) for i in range(layers)] if n else []
    spread = {k: [v[i] for i in picks] for k, v in defaults.items() if n and isinstance(v, list) and len(v) == n}
    sizes = {k: v for k, v in {**TINY, "num_hidden_layers": layers}.items() if k in defaults}
    # dropout off (Seed-OSS defaults to 0.1): the matrix proves the strategies; each architecture's keyed dropout is
    # proven on its own (tests/test_dropout.py)
    quiet = {k: 0.0 for k, v in defaults.items() if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v}
    own = {k: v for k, v in FIELDS.get(model_type, {}).items() if k in defaults}  # _MLA names a superset
    return AutoConfig.for_model(model_type, **{**sizes, **spread, **quiet, **own, **fields})


def tiny_or_skip(arch: str):
    """(`arch`'s tiny config, the fields it changes from the architecture's defaults, as model.config passes them), or
    the test skipped saying why: a config that does not build at that size, or keeps too many parameters there."""
    import pytest
    from transformers import AutoConfig

    try:
        config = tiny_config(arch, layers=2)
        reason = too_large(config)
    except Exception as error:  # noqa: BLE001 - the reason is the skip's
        reason = f"its config does not build at a tiny size: {error}"
    if reason:
        pytest.skip(reason + " (the architecture matrix skips it too)")
    defaults = AutoConfig.for_model(arch).to_dict()
    return config, {
        k: v for k, v in config.to_dict().items() if k in defaults and v != defaults[k] and k != "vocab_size"
    }


def too_large(config, limit: int = 20_000_000) -> str | None:
    """Why `config` is no CPU size (built on the meta device, nothing allocated), or None: an architecture whose
    config names its sizes otherwise than TINY keeps its defaults' hundreds of millions of parameters."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    return f"{config.model_type} keeps {size / 1e6:.0f}M parameters at TINY's sizes" if size > limit else None


def eager_experts(model):
    """`model` (a transformers model) with its experts run one by one: the grouped kernel transformers picks for
    mixture-of-experts layers takes no float64, and the tests compare in float64."""
    if any(v not in (None, "eager") for v in getattr(model, "get_experts_implementation", dict)().values()):
        model.set_experts_implementation("eager")
    return model
