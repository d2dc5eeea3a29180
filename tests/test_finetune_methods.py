"""P-tuning (peft), bottleneck adapters (src/lm/features/bottleneck.py) and frozen layers (model.freeze): what each one
computes and trains, and each under DDP and FSDP2 == 1 process, evaluated by eval.py, exported and loaded back."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import FULL_MATRIX_ONLY
from lightning.pytorch.strategies import SingleDeviceStrategy
from test_architectures_parity import STRATEGIES, eval_val_loss, llama_args
from test_fsdp import last_ckpt, train_sharded
from test_parity import GPT2, assert_same_series, max_param_diff, train

from src.lm.features import frozen as freezing
from src.lm.features.bottleneck import BottleneckConfig
from src.lm.models.gpt2_module import GPT2LitModule
from src.utils.config import ConfigError
from tests.helpers.margins import close64, close_fp32_weights, within

SMALL = {"vocab_size": 257, "seq_len": 32, "n_layer": 2, "n_head": 2, "n_embd": 16, "attn_implementation": "eager"}


def test_bottleneck_adapters_compute_the_houlsby_formula_in_float64():
    """Each block: h = x + a + up(relu(down(a))) with a the attention's output, out = h + m + up'(relu(down'(m))) with
    m the MLP's; the adapters start at the base model's function exactly (up is zero), and only they train."""
    torch.manual_seed(0)
    base = GPT2LitModule(**SMALL).double().eval()
    adapted = copy.deepcopy(base)
    from src.lm.features import bottleneck

    bottleneck.add(adapted.model, BottleneckConfig(reduction_factor=4, placement="both", seed=3))
    assert {n for n, p in adapted.named_parameters() if p.requires_grad} == {
        f"model.transformer.h.{i}.{s}.bottleneck.{p}.{w}"
        for i in (0, 1)
        for s in ("attn", "mlp")
        for p in ("down", "up")
        for w in ("weight", "bias")
    }
    ids = torch.randint(0, 257, (2, 12))
    with torch.no_grad():
        assert torch.equal(adapted.double()(ids).logits, base(ids).logits)  # up = 0: the base's function exactly
        for p in adapted.parameters():
            if p.requires_grad:
                p.normal_(0.0, 0.3)
    block = adapted.hf_model.transformer.h[0]
    seen: dict = {}
    block.register_forward_pre_hook(lambda m, a, k: seen.update(x=a[0]), with_kwargs=True)
    block.attn.register_forward_pre_hook(lambda m, a, k: seen.update(attn=(a, k)), with_kwargs=True)
    block.ln_2.register_forward_pre_hook(lambda m, a: seen.update(h=a[0]))
    block.register_forward_hook(lambda m, a, out: seen.update(out=out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        adapted(ids)

        def formula(y, adapter):  # written out, not the module's forward
            down, up = adapter.down, adapter.up
            return y + F.linear(F.relu(F.linear(y, down.weight, down.bias)), up.weight, up.bias)

        args, kwargs = seen["attn"]
        a = block.attn.forward(*args, **kwargs)[0]  # forward(): the sublayer without its hook
        close64(seen["h"], seen["x"] + formula(a, block.attn.bottleneck), "after the attention")
        m = block.mlp.forward(block.ln_2(seen["h"]))
        close64(seen["out"], seen["h"] + formula(m, block.mlp.bottleneck), "after the MLP")
    with pytest.raises(ValueError, match="placement='ffn' is not one of attention, mlp, both"):
        BottleneckConfig(placement="ffn")


def test_freeze_leaves_only_the_rest_to_the_optimizer():
    """What each model.freeze choice freezes has requires_grad False, is not in the optimizer and gets no gradient."""
    expected = {
        "embeddings": lambda n: "wte" in n or "wpe" in n,  # tied: the head is wte
        "all_but_head": lambda n: "wte" not in n,  # tied: the head is wte, which trains
        "first_k_blocks": lambda n: "wte" in n or "wpe" in n or ".h.0." in n,
    }
    for choice, freeze in (("embeddings", "embeddings"), ("all_but_head", "all_but_head"),
                           ("first_k_blocks", {"first_k_blocks": 1})):  # fmt: skip
        module = GPT2LitModule(**SMALL, freeze=freeze, optimizer=partial(torch.optim.AdamW, lr=1e-3))
        frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
        assert frozen == {n for n, _ in module.named_parameters() if expected[choice](n)}, choice
        module._trainer = SimpleNamespace(strategy=SingleDeviceStrategy(torch.device("cpu")))
        optimizer = module.configure_optimizers()
        optimizer, module._trainer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer, None
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        assert in_optimizer == {id(p) for p in module.parameters() if p.requires_grad}, choice
        ids = torch.randint(0, 257, (2, 8))
        module(ids, ids).loss.backward()
        assert all((p.grad is None) == (n in frozen) for n, p in module.named_parameters()), choice
    with pytest.raises(ConfigError, match=r"model.freeze=top is not one of null \| embeddings"):
        freezing.check("top", False)
    with pytest.raises(ConfigError, match="with an adapter .*; set model.freeze=null"):
        freezing.check("embeddings", True)
    with pytest.raises(ConfigError, match="first_k_blocks=3 but the model has 2 blocks: lower it"):
        GPT2LitModule(**SMALL, freeze={"first_k_blocks": 3})


def test_bad_options_are_one_sentence_before_any_rank(tmp_path):
    from test_configs import compose_cfg

    from src.run.checks import resolve_and_check_values

    for overrides, sentence in (
        (["model/peft=bottleneck_adapters", "model.peft.placement=ffn"], "placement='ffn' is not one of attention"),
        (["model/peft=bottleneck_adapters", "model.peft.reduction_factor=0"], "reduction_factor=0 is below 1"),
        (["model.freeze=top"], "model.freeze=top is not one of"),
        (["model.freeze={first_k_blocks: 0}"], r"model.freeze={'first_k_blocks': 0} is not one of .* \(K >= 1\)"),
        (["model.freeze=embeddings", "model.lora.enabled=true"], "an adapter already freezes the whole model"),
        (["model.freeze=embeddings", "trainer=pipeline", "trainer.devices=2"], "model.freeze is not supported with"),
        (["model/peft=bottleneck_adapters", "trainer=tp", "trainer.devices=2"], "model/peft is not supported with"),
    ):
        with pytest.raises(ConfigError, match=sentence):
            resolve_and_check_values(compose_cfg(overrides, tmp=tmp_path))


# ---- each method through train.py: N ranks == 1 process, eval.py, export-hf loaded by a clean client ----

METHODS = {
    # GPT-2 built from a config with room for the virtual tokens in its position table
    "p_tuning": [
        "model/peft=p_tuning",
        "model.peft.num_virtual_tokens=4",
        "model.peft.encoder_hidden_size=16",
        "+model.config.max_position_embeddings=64",
    ],  # fmt: skip
    "p_tuning_lstm": [
        "model/peft=p_tuning",
        "model.peft.num_virtual_tokens=4",
        "model.peft.encoder_hidden_size=16",
        "model.peft.encoder_reparameterization_type=LSTM",
        "+model.config.max_position_embeddings=64",
    ],  # fmt: skip
    "bottleneck": ["model/peft=bottleneck_adapters", "model.peft.reduction_factor=4"],
    "freeze": ["model.freeze={first_k_blocks: 1}"],
}
RUN = GPT2 + ["model.n_embd=32", "model.optimizer.lr=1e-2"]  # a larger LR: the small adapters move in 6 steps
GPT2_METHODS = list(METHODS)
METHODS["bottleneck_llama"] = METHODS["bottleneck"]  # Llama's sublayers: self_attn, mlp; an untied head
METHODS["freeze_llama"] = ["model.freeze=all_but_head"]
CASES = [(m, s) for m in ("p_tuning", "p_tuning_lstm", "bottleneck", "freeze") for s in ("ddp", "fsdp", "zero2")]
CASES += [("bottleneck", "zero3"), ("freeze", "zero3"), ("bottleneck_llama", "fsdp"), ("freeze_llama", "fsdp")]
CASES += [("freeze", "tp")]  # the adapters are refused under tp and pipeline, as every model/peft
CORE = [("p_tuning", "ddp"), ("bottleneck", "fsdp"), ("freeze", "fsdp")]


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,strategy",
    [pytest.param(m, s, marks=[] if (m, s) in CORE else [FULL_MATRIX_ONLY]) for m, s in CASES],
    ids=[f"{m}-{s}" for m, s in CASES],
)
def test_each_method_on_n_ranks_trains_as_one_process_evaluates_and_exports(tmp_path, reference, method, strategy):
    run_args = (llama_args(RUN) if method.endswith("llama") else RUN) + METHODS[method]
    one = reference(run_args)
    args = run_args + STRATEGIES[strategy]
    run = train(tmp_path, strategy, args) if strategy == "ddp" else train_sharded(tmp_path, strategy, args)
    ckpt = last_ckpt(tmp_path, strategy)
    from src.checkpoint.convert import load_checkpoint

    params = run["params"] if strategy == "ddp" else load_checkpoint(ckpt)["state_dict"]
    assert_same_series(one, run, "train/loss", 1e-5)
    assert_same_series(one, run, "val/loss", 1e-5)
    within(max_param_diff(one["params"], params), 1e-5, "params")
    if method.startswith("bottleneck"):  # the adapters trained (their up-projections start at zero)
        assert all(value.abs().max() > 0 for name, value in params.items() if "bottleneck.up.weight" in name)
    if method == "freeze":  # at another LR the frozen parameters (the embeddings, the head tied to them, block 0)
        other = reference(RUN + METHODS[method] + ["model.optimizer.lr=2e-2"])["params"]  # end where they started
        frozen = {n for n in params if any(part in n for part in ("wte", "wpe", "lm_head", ".h.0."))}
        assert frozen and all(torch.equal(other[n], params[n]) == (n in frozen) for n in params if "attn.bias" not in n)
    if (method, strategy) in CORE + [("p_tuning_lstm", "fsdp"), ("bottleneck_llama", "fsdp"), ("freeze_llama", "fsdp")]:
        within(abs(eval_val_loss(tmp_path, ckpt, []) - one["scalars"]["val/loss"][-1][1]), 5e-5, "eval.py val/loss")
        assert_a_clean_client_loads_the_export(tmp_path, ckpt, method)


CLIENT = {
    "freeze": """
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(out)
    """,
    "p_tuning": """
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"), out / "adapter")
    """,
    "bottleneck": """
        from transformers import AutoModelForCausalLM
        sys.path.insert(0, str(out / "adapter"))
        import bottleneck  # the loader export-hf wrote beside the adapters
        model = bottleneck.load(AutoModelForCausalLM.from_pretrained(out / "base"), out / "adapter")
    """,
}


def assert_a_clean_client_loads_the_export(tmp_path: Path, ckpt: Path, method: str) -> None:
    """export-hf's output, loaded by a process that has only torch, transformers (and peft for peft's methods): not
    this template (run outside it, no PYTHONPATH), gives the template module's logits in float64."""
    from src.checkpoint.convert import build_module, export_hf, load_checkpoint

    out = export_hf(ckpt, tmp_path / "hf")
    module, _ = build_module(load_checkpoint(ckpt))
    ids = torch.randint(0, 257, (2, 32))
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        expected = module.double().model(input_ids=ids).logits
    script = "import sys\nfrom pathlib import Path\nimport torch\n"
    kind = next(k for k in CLIENT if method.startswith(k))
    script += f"out = Path({str(out)!r})\n" + textwrap.dedent(CLIENT[kind])
    script += f"ids = torch.load({str(tmp_path / 'ids.pt')!r})\n"
    script += "with torch.no_grad():\n    logits = model.double().eval()(input_ids=ids).logits\n"
    script += f"torch.save(logits, {str(tmp_path / 'logits.pt')!r})\n"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, what = torch.load(tmp_path / "logits.pt"), f"{method}: the clean client's logits"
    if method.startswith("p_tuning"):  # peft saves the prompt encoder's output, in fp32, not the encoder
        close_fp32_weights(got, expected, what, module.hf_model.config.num_hidden_layers + 2)
    else:
        close64(got, expected, what)


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [pytest.param(m, marks=[FULL_MATRIX_ONLY]) for m in GPT2_METHODS],  # suite time: resumes are proven per strategy
)
def test_each_method_resumes_exactly_under_fsdp2(tmp_path, method):
    """6 steps under FSDP2, resumed to 12 == 12 straight: the adapter's (or the unfrozen part's) weights and Adam
    state come back from the sharded checkpoint, the frozen part has none."""
    from src.checkpoint.convert import load_checkpoint

    epoch = RUN + METHODS[method] + STRATEGIES["fsdp"]
    epoch += ["trainer.limit_train_batches=6", "trainer.val_check_interval=6", "model.scheduler=null"]
    train_sharded(tmp_path, "first", epoch)
    train_sharded(tmp_path, "resumed", epoch + [f"ckpt_path={last_ckpt(tmp_path, 'first')}", "trainer.max_steps=12"])
    train_sharded(tmp_path, "straight", epoch + ["trainer.max_steps=12"])
    resumed, straight = (load_checkpoint(last_ckpt(tmp_path, name)) for name in ("resumed", "straight"))
    assert resumed["global_step"] == straight["global_step"] == 12
    within(max_param_diff(resumed["state_dict"], straight["state_dict"]), 1e-6, "params")


def test_the_docs_trainable_parameter_counts_are_the_architectures(tmp_path):
    """docs/fine-tuning.md's table: each method's trainable parameters at GPT-2 124M's and Llama-3.2-1B's shapes,
    counted here on the meta device (no weights) as the template applies each method."""
    from conftest import ROOT
    from peft import LoraConfig, PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig, get_peft_model
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    from src.lm.features import bottleneck

    llama = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, head_dim=64)  # fmt: skip
    prompt = {"task_type": "CAUSAL_LM", "num_virtual_tokens": 16}
    methods = {
        "full fine-tuning": lambda m, _: m,
        "LoRA r=8": lambda m, targets: get_peft_model(m, LoraConfig(r=8, lora_alpha=16, target_modules=targets)),
        "prefix tuning": lambda m, _: get_peft_model(m, PrefixTuningConfig(**prompt)),
        "prompt tuning": lambda m, _: get_peft_model(m, PromptTuningConfig(**prompt)),
        "P-tuning (MLP": lambda m, _: get_peft_model(m, PromptEncoderConfig(**prompt, encoder_hidden_size=128)),
        "P-tuning (LSTM": lambda m, _: get_peft_model(
            m, PromptEncoderConfig(**prompt, encoder_hidden_size=128, encoder_reparameterization_type="LSTM")
        ),
        "bottleneck adapters r=16": lambda m, _: bottleneck.add(m, BottleneckConfig()),
        "bottleneck, MLP only": lambda m, _: bottleneck.add(m, BottleneckConfig(placement="mlp")),
        "freeze embeddings": lambda m, _: freezing.apply(m, freezing.check("embeddings", False), []),
        "freeze all but the head": lambda m, _: freezing.apply(m, freezing.check("all_but_head", False), []),
        "freeze the lower half": lambda m, _: freezing.apply(
            m, ("first_k_blocks", m.config.num_hidden_layers // 2), []
        ),
    }
    text = (ROOT / "docs" / "fine-tuning.md").read_text().split("## Which parameters train")[1]
    for column, (config, targets) in enumerate([(GPT2Config(), ["c_attn"]), (llama, None)]):
        for method, apply in methods.items():
            with torch.device("meta"):
                model = apply(AutoModelForCausalLM.from_config(config), targets)
            trainable = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad)
            (row,) = [line for line in text.splitlines() if line.startswith(f"| {method}")]
            documented = [cell.strip() for cell in row.strip("|").split(" | ")][2 + column]  # GPT-2's, Llama's
            assert int(documented.replace(",", "")) == trainable, (method, column, trainable)
