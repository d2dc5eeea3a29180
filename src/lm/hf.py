"""Hugging Face decoder-only language models, any architecture `AutoModelForCausalLM` builds: their config
from a model type or a pretrained dir, the checks that it is a causal LM, their repeated layers, and an
initialisation that does not depend on how the model is laid out over ranks (src/lm/init.py).

Nothing here names an architecture: what differs between GPT-2, Llama, Qwen2 and Mistral is read from the
model (its `_no_split_modules`, its norm and linear modules, its config). GPT-2's own choices (its init
scale, Conv1D) are in src/lm/models/gpt2_module.py.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

from src.lm import init
from src.utils.config import ConfigError

log = logging.getLogger(__name__)


def check_decoder_only(config: PretrainedConfig, source: str) -> None:
    """One sentence if `config` is not a decoder-only causal LM (BERT-like encoders have a causal-LM head in
    transformers too, but are trained as masked LMs; T5-like models are encoder-decoders)."""
    kind = config.model_type
    if (
        kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        or kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES
        or getattr(config, "is_encoder_decoder", False)
    ):
        raise ConfigError(
            f"{source} is a {kind!r} model, not a decoder-only causal LM: use a GPT-2, Llama, Qwen2, "
            "Mistral or other AutoModelForCausalLM checkpoint."
        )


WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")


def pretrained_config(name_or_path: str, attn_implementation: str = "sdpa") -> PretrainedConfig:
    """The config of a pretrained dir or hub name (no weights read), checked to be a decoder-only LM."""
    try:
        config = AutoConfig.from_pretrained(name_or_path, attn_implementation=attn_implementation)
    except (OSError, ValueError, KeyError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(
            f"model.pretrained={name_or_path!r} could not be loaded ({first}). Pass a local dir with "
            "config.json + model.safetensors, or a hub name such as gpt2 when online."
        ) from e
    check_decoder_only(config, f"model.pretrained={name_or_path!r}")
    local = Path(name_or_path)
    if local.is_dir() and not any(next(local.glob(pattern), None) for pattern in WEIGHT_FILES):
        # checked here, when the module is built: under FSDP2/ZeRO-3 the weights are read only after the ranks start
        raise ConfigError(
            f"model.pretrained={name_or_path!r} holds a config but no weights (no *.safetensors or "
            "pytorch_model*.bin): pass the dir that save_pretrained or `python -m src.tools.checkpoints "
            "export-hf` wrote."
        )
    return config


def new_config(model_type: str, attn_implementation: str, **fields: Any) -> PretrainedConfig:
    """A fresh config of `model_type` (gpt2, llama, qwen2, mistral, ...) with `fields` set."""
    try:
        config = AutoConfig.for_model(model_type, attn_implementation=attn_implementation, **fields)
    except ValueError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(
            f"model.model_type={model_type!r} is not a model type transformers knows ({first})."
        ) from None
    check_decoder_only(config, f"model.model_type={model_type!r}")
    return config


# the attention implementations transformers names, and the class flag that says a model supports each
ATTENTION_SUPPORT = {
    "sdpa": "_supports_sdpa",
    "flex_attention": "_supports_flex_attn",
    "flash_attention_2": "_supports_flash_attn",
    "flash_attention_3": "_supports_flash_attn",
}


def causal_lm_class(model_type: str) -> type[PreTrainedModel]:
    """The class AutoModelForCausalLM builds for `model_type` (GPT2LMHeadModel, Gemma2ForCausalLM, ...)."""
    import transformers

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def supported_attention(model_type: str) -> list[str]:
    """The attention implementations `model_type`'s class supports: eager always, the others as its flags say
    (transformers' own `_supports_sdpa`, `_supports_flex_attn`, `_supports_flash_attn`: tests/test_private_names.py)."""
    cls = causal_lm_class(model_type)
    return ["eager"] + [name for name, flag in ATTENTION_SUPPORT.items() if getattr(cls, flag, False)]


def choose_attention(model_type: str, requested: str, fastest: str = "sdpa") -> str:
    """model.attn_implementation: `auto` takes `fastest` (the machine's faster kernel, src/utils/machine.py) where the
    model supports it, else eager; a named one the model does not support is one sentence naming what it does."""
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:  # no causal LM: said in one sentence when it is built
        return fastest if requested == "auto" else requested
    supported = supported_attention(model_type)
    if requested == "auto":
        return fastest if fastest in supported else "eager"
    if requested in ATTENTION_SUPPORT and requested not in supported:
        raise ConfigError(
            f"model.attn_implementation={requested} is not one {causal_lm_class(model_type).__name__} supports: "
            f"use auto or one of {', '.join(supported)}."
        )
    return requested


def load_pretrained(
    name_or_path: str, attn_implementation: str = "sdpa", config: Optional[PretrainedConfig] = None
) -> PreTrainedModel:
    """The whole pretrained model; with `config` (the checkpoint's, changed), built from that."""
    config = config or pretrained_config(name_or_path, attn_implementation)  # one sentence if not a decoder-only LM
    try:
        return AutoModelForCausalLM.from_pretrained(name_or_path, config=config)
    except Exception as e:  # noqa: BLE001 - whatever transformers or safetensors raise, the sentence names it
        first = f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0][:200]
        raise ConfigError(
            f"model.pretrained={name_or_path!r} did not load in transformers ({first}): pass a dir that "
            "save_pretrained wrote (config.json + model.safetensors), or fix what the message names."
        ) from e


def build_on_meta(
    config: PretrainedConfig, constructor_values: Optional[dict[str, torch.Tensor]] = None
) -> PreTrainedModel:
    """The model's parameters on the meta device (no memory, no RNG draws) and its buffers as an eager build
    computes them, on the CPU (accelerate's `init_empty_weights(include_buffers=False)`): what no checkpoint
    stores (RoPE's inv_freq, Gemma's embed_scale, Apertus' xIELU beta and eps) keeps its value through
    `init.allocate`, whatever computes it. Each parameter is created on the CPU and moved to meta as its module
    registers it: one parameter's memory at a time, never the model's. `constructor_values`, when given, gets by
    name the value each parameter of up to RECORDED_PARAMETER_SIZE elements had when it was registered (Apertus'
    xIELU alpha_p: set by its constructor, which its _init_weights leaves)."""
    from accelerate import init_empty_weights

    record: dict[tuple[int, str], torch.Tensor] = {}
    # some modules draw a parameter's value before registering it (Qwen3-Next's A_log): under a forked RNG that draw
    # leaves no trace, so every rank's later draws are those of a build on meta
    with torch.random.fork_rng(devices=[]), init_empty_weights(include_buffers=False):
        to_meta = nn.Module.register_parameter  # accelerate's: moves the parameter to meta as it registers

        def register(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
            if param is not None and not param.is_meta and param.numel() <= RECORDED_PARAMETER_SIZE:
                record[(id(module), name)] = param.detach().clone()
            to_meta(module, name, param)

        if constructor_values is not None:
            nn.Module.register_parameter = register
        try:
            model = AutoModelForCausalLM.from_config(config)
        finally:
            nn.Module.register_parameter = to_meta
    model.tie_weights()  # the patch gives each registration its own meta parameter: a tied head would come untied
    if constructor_values is not None:
        for prefix, module in model.named_modules():
            for name, _ in module.named_parameters(recurse=False):
                if (id(module), name) in record:
                    constructor_values[f"{prefix}.{name}" if prefix else name] = record[(id(module), name)]
    return model


RECORDED_PARAMETER_SIZE = 2**20  # build_on_meta's constructor values: kept for parameters up to this many elements


def context_length(config: PretrainedConfig) -> int:
    """The model's position table (GPT-2's n_positions) or RoPE's trained context."""
    return int(config.max_position_embeddings)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of repeated decoder layers: the ModuleList of the class that transformers itself keeps
    whole when it splits a model over devices (`_no_split_modules`: GPT2Block, LlamaDecoderLayer, ...)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and type(module[0]).__name__ in names:
            return module
    raise ConfigError(
        f"{type(model).__name__} lists no decoder layers (its _no_split_modules is {sorted(names)}): "
        "it cannot be sharded or split; train it with trainer=default or trainer=ddp."
    )


def is_norm(module: nn.Module) -> bool:
    """LayerNorm and RMSNorm classes, whatever their per-architecture names (transformers' own rule)."""
    name = type(module).__name__
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or "LayerNorm" in name or "RMSNorm" in name


def standard_fill(model: nn.Module, std: float) -> init.Fill:
    """transformers' default initialisation (PreTrainedModel._init_weights, which Llama, Qwen2 and Mistral use):
    N(0, std) for linear and embedding weights, ones for norm gains, zeros for biases; drawn per parameter.
    The parameter's kind is read from its module in `model`, so the rule holds for any architecture."""
    norms = {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if is_norm(module)
        for name, _ in module.named_parameters(recurse=False)
    }

    def fill(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        if name.endswith(".bias"):
            tensor.zero_()
        elif name in norms:
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, std, generator=generator)

    return fill


def architecture_fill(model: nn.Module, fallback: init.Fill) -> init.Fill:
    """The architecture's own initialisation, one parameter at a time, from the parameter's own generator.

    transformers initialises a new model by calling its `_init_weights` on every module, children before parents
    (`initialize_weights`: Gemma's zero-centred norm gains, Mamba's and the gated delta rule's A_log, D and
    dt_bias, GPT-2's scaled residual projections, ...), all from the global RNG, module by module: its values
    depend on which modules a rank holds. Here a parameter's value is that same rule replayed on a meta-device
    copy of the model in which only this parameter is real: `_init_weights` runs on its module and then on each
    module above it (the parents' rules win, as in transformers), every other parameter a meta tensor that takes no
    draw, and the global RNG seeded from the parameter's generator (forked: the caller's RNG does not move). So
    every layout (one process, FSDP2 shards, ZeRO-3 partitions, tensor and pipeline ranks) gets the same values, in
    the architecture's own distribution. A parameter the copy does not hold in that shape (a reward head, an
    adapter) takes `fallback`. Private name with a canary: `_init_weights` (tests/test_architectures.py)."""
    from transformers import initialization

    built: dict[str, torch.Tensor] = {}
    skeleton = build_on_meta(model.config, built)
    modules = dict(skeleton.named_modules())
    params = dict(skeleton.named_parameters())

    owners = init.init_owners(skeleton)  # the PreTrainedModel whose _init_weights transformers applies to each

    def fill(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        if name not in params or params[name].shape != tensor.shape:
            return fallback(name, tensor, generator)
        owner_name, _, attr = name.rpartition(".")
        owner = modules[owner_name]
        original = getattr(owner, attr)
        # what the module's constructor gave it (kept for small parameters), which a rule may leave as it is
        start = built.get(name)
        real = nn.Parameter(start.float() if start is not None else torch.full(tensor.shape, math.nan), False)
        parts = owner_name.split(".") if owner_name else []
        chain = [".".join(parts[:i]) for i in range(len(parts), -1, -1)]  # the owner, then each module above it
        seed = int(torch.randint(0, 2**62, (), generator=generator))
        with torch.random.fork_rng(devices=[]), torch.no_grad(), initialization.guard_torch_init_functions():
            torch.manual_seed(seed)
            setattr(owner, attr, real)
            try:
                for module_name in chain:
                    owners[modules[module_name]]._init_weights(modules[module_name])
            finally:
                setattr(owner, attr, original)
        if real.isnan().any():
            raise ConfigError(
                f"{model.config.model_type}'s {name} takes its initial value in its module's constructor, which "
                "a model built on the meta device does not run: start from a checkpoint (model.pretrained=DIR)."
            )
        tensor.copy_(real)

    return fill


def resize_vocab(model: PreTrainedModel, vocab_size: int, base_seed: int, tokenizer: Optional[str] = None) -> None:
    """Embeddings (and an untied head) resized for tokens added to the tokenizer; the new rows are drawn from
    base_seed, so every rank and every build path gets the same, and the global RNG is left alone. A tokenizer
    extended by src.tools.vocab records the base tokens each new one replaces: its rows start as their mean."""
    import json
    from pathlib import Path

    old = model.config.vocab_size
    log.info(f"Resizing the embeddings from {old} to {vocab_size} tokens")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(base_seed)
        model.resize_token_embeddings(vocab_size)
    record = Path(tokenizer or "") / "vocab_extension.json"
    if not tokenizer or not record.is_file():
        return
    extension = json.loads(record.read_text(encoding="utf-8"))
    if extension["base_vocab_size"] != old:
        raise ConfigError(
            f"{tokenizer} extends a tokenizer of {extension['base_vocab_size']} tokens and the model has "
            f"{old} embeddings: extend the model's own tokenizer (src.tools.vocab extend --tokenizer)."
        )
    tables = [model.get_input_embeddings().weight]
    head = model.get_output_embeddings()
    if head is not None and head.weight is not tables[0]:
        tables.append(head.weight)  # an untied head: its new rows likewise
    with torch.no_grad():
        for table in tables:
            for new_id, base_ids in extension["pieces"].items():
                table[int(new_id)] = table[base_ids].mean(dim=0)
    log.info(f"{len(extension['pieces'])} new embedding rows start as the mean of the base tokens they replace")


def lora_config(r: int, alpha: int, dropout: float, target_modules: Optional[list[str]], model: nn.Module):
    """peft's LoraConfig; target_modules=None: peft's default for the architecture (GPT-2: c_attn; Llama, Qwen2,
    Mistral: q_proj, v_proj). Names the model does not have are one sentence listing the ones it has."""
    from peft import LoraConfig
    from transformers.pytorch_utils import Conv1D

    linear = sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D)) and name}
    )
    missing = [t for t in target_modules or [] if t not in linear]
    if missing:
        raise ConfigError(
            f"model.lora.target_modules={list(target_modules)} names {missing}, which "
            f"{type(model).__name__} does not have: pick from {linear}."
        )
    fan_in_fan_out = any(isinstance(m, Conv1D) for m in model.modules())  # GPT-2 stores its weights transposed
    return LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        task_type="CAUSAL_LM",
        fan_in_fan_out=fan_in_fan_out,
        target_modules=list(target_modules) if target_modules else None,
    )
