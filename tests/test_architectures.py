"""Any Hugging Face decoder LM, not only GPT-2: Llama (grouped-query attention, untied head), Qwen2 (q/k/v biases,
tied embeddings) and Mistral (sliding window) built from a config or loaded pretrained, in-process. Their runs
on N ranks against one process are in tests/test_architectures_parity.py."""

from __future__ import annotations

import pytest
import torch
from test_model import assert_batched_generation_is_the_oracles
from transformers import AutoConfig, AutoModelForCausalLM

from src.lm import hf, init
from src.lm.models.causal_lm import CausalLMLitModule
from src.lm.models.gpt2_module import GPT2LitModule
from src.utils.config import ConfigError
from tests.helpers.margins import close64

V, T = 257, 32
SHAPE = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
}
ARCHS = {
    "llama": {"model_type": "llama", "config": {**SHAPE, "tie_word_embeddings": False}},
    "qwen2": {"model_type": "qwen2", "config": {**SHAPE, "tie_word_embeddings": True}},
    "mistral": {"model_type": "mistral", "config": {**SHAPE, "tie_word_embeddings": False, "sliding_window": 8}},
}


def build(arch: str, **kwargs) -> CausalLMLitModule:
    return CausalLMLitModule(vocab_size=V, seq_len=T, **ARCHS[arch], **kwargs)


def saved(tmp_path, arch: str, seed: int = 0):
    """A save_pretrained dir of a random model of `arch` (transformers' own init, not ours)."""
    config = AutoConfig.for_model(
        ARCHS[arch]["model_type"], vocab_size=V, max_position_embeddings=64, **ARCHS[arch]["config"]
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / arch)
    return tmp_path / arch, model.eval()


def test_each_architecture_is_built_with_what_makes_it_differ():
    llama, qwen2, mistral = build("llama").model, build("qwen2").model, build("mistral").model
    attn = llama.model.layers[0].self_attn
    assert attn.k_proj.weight.shape == (2 * 8, 32) and attn.q_proj.weight.shape == (4 * 8, 32)  # GQA
    assert llama.lm_head.weight is not llama.model.embed_tokens.weight  # untied
    assert type(llama.model.norm).__name__ == "LlamaRMSNorm" and hasattr(llama.model.layers[0].mlp, "gate_proj")
    assert qwen2.model.layers[0].self_attn.q_proj.bias is not None  # q/k/v biases
    assert qwen2.lm_head.weight is qwen2.model.embed_tokens.weight  # tied
    assert mistral.config.sliding_window == 8 and llama.config.max_position_embeddings == T


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_deferred_init_gives_the_eager_values_and_transformers_rotary_buffers(arch):
    """Built on meta and materialised (as FSDP2 and ZeRO-3 do, shard by shard) == built in place; the rotary
    inv_freq, a buffer `to_empty` leaves as garbage, is transformers' own; init follows transformers' rule."""
    torch.manual_seed(0)
    eager = build(arch)
    torch.manual_seed(0)
    with init.deferred_init():
        deferred = build(arch)
    assert init.has_meta(deferred.model)
    deferred.materialize(torch.device("cpu"), sharded=False)
    for (name, a), (_, b) in zip(eager.model.named_parameters(), deferred.model.named_parameters()):
        assert torch.equal(a, b), name
    with torch.device("cpu"):
        reference = AutoModelForCausalLM.from_config(eager.config)  # computes its buffers itself
    for name, buffer in reference.named_buffers():
        assert torch.equal(dict(deferred.model.named_buffers())[name], buffer), name
    layer = eager.model.model.layers[0]
    assert torch.equal(layer.input_layernorm.weight, torch.ones(32))
    assert layer.self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.15)
    if arch == "qwen2":
        assert torch.equal(layer.self_attn.q_proj.bias, torch.zeros(32))
    with torch.no_grad():
        ids = torch.randint(0, V, (2, T))
        torch.testing.assert_close(eager(ids).logits, deferred(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_pretrained_dir_gives_transformers_logits_eager_and_through_meta_init(tmp_path, arch):
    """model.pretrained=DIR: the template's step-0 logits are transformers' own, whether the module loads the
    weights at once or builds on meta and loads them when the strategy materialises it (rank 0 + broadcast)."""
    path, reference = saved(tmp_path, arch)
    ids = torch.randint(0, V, (2, 24))
    with torch.no_grad():
        expected = reference.double()(ids).logits
    eager = CausalLMLitModule(vocab_size=V, seq_len=T, pretrained=str(path))
    with init.deferred_init():
        deferred = CausalLMLitModule(vocab_size=V, seq_len=T, pretrained=str(path))
    deferred.materialize(torch.device("cpu"), sharded=False)
    for module in (eager, deferred):
        with torch.no_grad():
            close64(module.double()(ids).logits, expected, "the template's logits")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("adapter", ["none", "lora"])
def test_flop_count_is_within_2_percent_of_flop_counter(arch, adapter):
    """The count walks any decoder by rules (src/lm/features/flops.py); torch's FlopCounterMode counts what a real
    forward + backward runs. GQA's narrower k/v, SwiGLU's three matrices, an untied head, LoRA's frozen base."""
    from torch.utils.flop_counter import FlopCounterMode

    lora = {"enabled": True, "r": 2, "alpha": 4, "dropout": 0.0, "target_modules": None} if adapter == "lora" else None
    config = {**ARCHS[arch]["config"], "sliding_window": None} if arch == "mistral" else ARCHS[arch]["config"]
    model = CausalLMLitModule(
        vocab_size=V, seq_len=T, model_type=arch, config=config, lora=lora, attn_implementation="eager"
    )
    ids = torch.randint(0, V, (2, T))
    with FlopCounterMode(display=False) as counter:
        model.model(input_ids=ids).logits.sum().backward()
    counted, ours = counter.get_total_flops(), int(model.flops_of_batch({"input_ids": ids}))
    assert abs(ours - counted) <= 0.02 * counted, (ours, counted)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_left_padded_prompts_complete_as_greedy_full_forwards(arch):
    """One left-padded batch for all prompts: rotary positions follow the mask, so each completion is what
    decoding that prompt alone by full forwards gives."""
    model = build(arch).model
    torch.manual_seed(0)
    with torch.no_grad():  # large random weights: the next token depends on every position
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    assert_batched_generation_is_the_oracles(model)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["prompt_tuning", "prefix_tuning"])
def test_prompt_learning_prompts_complete_as_greedy_full_forwards(arch, method):
    """Prompt and prefix tuning on a rotary, grouped-query model (prefix tuning's key/value cache has the
    key/value heads' width): left-padded batched generation equals each prompt decoded alone by full forwards."""
    from peft import PrefixTuningConfig, PromptTuningConfig

    peft = {"prompt_tuning": PromptTuningConfig, "prefix_tuning": PrefixTuningConfig}[method](
        task_type="CAUSAL_LM", num_virtual_tokens=4
    )
    config = {**ARCHS[arch]["config"], "max_position_embeddings": 64}  # room for the virtual tokens
    model = CausalLMLitModule(vocab_size=V, seq_len=T, model_type=arch, config=config, peft=peft).model
    torch.manual_seed(0)
    with torch.no_grad():  # large random weights, the learned tokens too: the next token depends on every position
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    assert_batched_generation_is_the_oracles(model)


def test_lora_defaults_to_the_architectures_projections_and_names_what_a_model_has():
    lora = {"enabled": True, "r": 2, "alpha": 4, "dropout": 0.0, "target_modules": None}
    model = build("llama", lora=lora).model
    wrapped = {name.split(".lora_A")[0].split(".")[-1] for name, _ in model.named_parameters() if "lora_A" in name}
    assert wrapped == {"q_proj", "v_proj"}  # peft's default for Llama
    assert all(p.requires_grad == ("lora_" in name) for name, p in model.named_parameters())
    with pytest.raises(ConfigError, match=r"names \['c_attn'\].*pick from \[.*'q_proj'.*\]") as error:
        build("llama", lora={**lora, "target_modules": ["c_attn"]})
    assert "\n" not in str(error.value)


def test_bad_models_are_one_sentence(tmp_path):
    from transformers import BertConfig, T5Config

    for name, config in (
        ("bert", BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)),
        ("t5", T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64)),
    ):
        config.save_pretrained(tmp_path / name)
        with pytest.raises(ConfigError, match=f"is a '{name}' model, not a decoder-only causal LM"):
            CausalLMLitModule(vocab_size=V, seq_len=T, pretrained=str(tmp_path / name))
    llama, _ = saved(tmp_path, "llama")
    with pytest.raises(ConfigError, match="is a 'llama' model and model=gpt2 builds GPT-2: use model=causal_lm"):
        GPT2LitModule(vocab_size=V, seq_len=T, pretrained=str(llama))
    (llama / "model.safetensors").unlink()  # a config without weights: eager, and deferred (FSDP2, ZeRO-3), where
    for deferred in (False, True):  # the weights are read only once the ranks run
        with init.deferred_init(deferred), pytest.raises(ConfigError, match="holds a config but no weights"):
            CausalLMLitModule(vocab_size=V, seq_len=T, pretrained=str(llama))
    with pytest.raises(ConfigError, match="model.model_type='lama' is not a model type transformers knows"):
        CausalLMLitModule(vocab_size=V, seq_len=T, model_type="lama")
    with pytest.raises(ConfigError, match="model.model_type is not set"):
        CausalLMLitModule(vocab_size=V, seq_len=T)


def test_attention_is_one_the_model_supports_and_a_failed_load_says_what_failed(tmp_path):
    """model.attn_implementation=auto takes the machine's faster kernel only where the class supports it (Gemma2 has
    no SDPA: a default that ignored it failed with "has no weights that load"); a named unsupported one, and a
    load that fails, are one sentence saying what failed."""
    small = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    small.update(num_hidden_layers=2, head_dim=8)
    assert "sdpa" not in hf.supported_attention("gemma2") and "sdpa" in hf.supported_attention("llama")
    gemma2 = CausalLMLitModule(vocab_size=V, seq_len=T, model_type="gemma2", config=small)
    assert gemma2.attn_implementation == gemma2.config._attn_implementation == "eager"
    llama = CausalLMLitModule(vocab_size=V, seq_len=T, model_type="llama", config=small, fastest_attention="sdpa")
    assert llama.attn_implementation == llama.config._attn_implementation == "sdpa"
    with pytest.raises(
        ConfigError, match=r"attn_implementation=sdpa is not one Gemma2ForCausalLM supports: use auto or one of eager, "
    ):
        CausalLMLitModule(vocab_size=V, seq_len=T, model_type="gemma2", config=small, attn_implementation="sdpa")
    gemma2.hf_model.save_pretrained(tmp_path / "gemma2")  # pretrained: the same choice, read from its config
    assert (
        CausalLMLitModule(vocab_size=V, seq_len=T, pretrained=str(tmp_path / "gemma2")).attn_implementation == "eager"
    )
    (tmp_path / "gemma2" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match=r"did not load in transformers \(.*\): pass a dir") as error:
        CausalLMLitModule(vocab_size=V, seq_len=T, pretrained=str(tmp_path / "gemma2"))
    assert "\n" not in str(error.value)


def test_canary_transformers_init_weights_recomputes_rotary_buffers():
    """src/lm/init.py `allocate` calls transformers' private `_init_weights` on buffer-only modules (RoPE):
    this fails by name if transformers renames it or stops recomputing inv_freq there."""
    model = build("llama").model
    rotary = model.model.rotary_emb
    expected = rotary.inv_freq.clone()
    rotary.inv_freq.fill_(float("nan"))
    model._init_weights(rotary)
    assert torch.equal(rotary.inv_freq, expected)


@pytest.mark.parametrize(
    "override,fragment",
    [
        (
            ["model=llama", "trainer.devices=4", "trainer.strategy.tensor_parallel_size=4"],
            "num_attention_heads=4, num_key_value_heads=2 and intermediate_size=352 must all divide by "
            "trainer.strategy.tensor_parallel_size=4",
        ),
        (
            ["model=causal_lm", "model.model_type=opt", "+model.config.num_hidden_layers=1"],
            "trainer=tp needs a tensor-parallel plan and opt's config has none",
        ),
        (  # MLA's mla_kv_a_proj is not among trainer=tp's styles (experts are: src/parallel/tensor/experts.py)
            ["model=causal_lm", "model.model_type=glm4_moe_lite", "+model.config.num_hidden_layers=1"],
            "glm4_moe_lite's tensor-parallel plan uses the style(s) ['mla_kv_a_proj'], which trainer=tp does not "
            "implement (colwise, rowwise, colwise_gather_output, rowwise_split_input, replicated_with_grad_allreduce, "
            "packed_colwise, packed_rowwise, moe_tp_experts): train it with trainer=fsdp or trainer=ddp.",
        ),
    ],
)
def test_tensor_parallel_config_errors_name_the_architectures_numbers(tmp_path, override, fragment):
    """Read from the architecture's config before any rank starts (src/architectures/config.py)."""
    from test_configs import compose_cfg
    from test_errors import FAST

    from src.run.checks import resolve_and_check_values

    fast = [o for o in FAST if not o.startswith("model.n_layer")]
    cfg = compose_cfg([*fast, "trainer=tp", "trainer.devices=2", *override], tmp=tmp_path)
    with pytest.raises(ConfigError) as error:
        resolve_and_check_values(cfg)
    assert fragment in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gradient_checkpointing_and_a_padded_batch_change_no_numbers(arch):
    """Recomputing each layer in backward gives the same loss and gradients; a right-padded batch (instruction
    data: attention_mask zeros, labels -100) gives each row the loss it has alone."""
    from test_finetune import assert_checkpointing_changes_no_numbers

    assert_checkpointing_changes_no_numbers(lambda gc: build(arch, gradient_checkpointing=gc))
    module = build(arch).eval().double()
    ids = torch.randint(0, V, (2, T))
    short = ids[1, :20]
    padded = torch.cat([short, torch.zeros(T - 20, dtype=torch.long)])[None]
    labels = torch.cat([short[1:], torch.full((T - 19,), -100)])[None]
    mask = (torch.arange(T) < 20).long()[None]
    with torch.no_grad():
        alone = module(short[None], labels[:, :20]).loss
        close64(module(padded, labels, attention_mask=mask).loss, alone, "padded row's loss")
