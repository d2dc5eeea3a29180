"""trainer=deepspeed: the derived DeepSpeed config, and ZeRO 1/2/3 (+ CPU offload) on gloo against DDP.

Lightning refuses DeepSpeed without CUDA, so the multi-process runs use tests/helpers/deepspeed_cpu.py
(our strategy minus Lightning's device checks). DeepSpeed JIT-builds its CPU Adam and shared-memory
all-reduce on first use (about 1.5 min on 2 cores), once per clone: conftest.torch_extensions_dir.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import FULL_MATRIX_ONLY

from src.parallel.deepspeed import DeepSpeedStrategy, derive_config
from src.utils.config import ConfigError
from tests.helpers.margins import close64, within

# ---- what ZeRO-3 leaves where it was made (fast) ----


def test_the_strategys_setup_places_every_metric_and_buffer_on_its_device():
    """Under ZeRO-3 neither DeepSpeed nor Lightning moves what is not a partitioned parameter: DeepSpeedStrategy.setup
    places the evaluation metrics (DPO's pair statistics) and the buffers (Llama's rotary frequencies) on the root
    device. A CPU has one device, so the move is checked towards the meta device; parameters stay."""
    from src.lm.models.causal_lm import CausalLMLitModule
    from src.lm.objectives.dpo import DPO
    from src.parallel.deepspeed import place_states

    config = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "intermediate_size": 32}  # fmt: skip
    module = CausalLMLitModule(vocab_size=100, seq_len=16, model_type="llama", config=config, objective=DPO())
    metrics = [m for m in module.modules() if type(m).__name__ == "MeanStats"]
    assert len(metrics) == 2 and len(list(module.buffers())) >= 1
    place_states(module, torch.device("meta"))
    assert all(state.is_meta for m in metrics for state in m.metric_state.values())
    assert all(b.is_meta for b in module.buffers()) and not any(p.is_meta for p in module.parameters())
    assert all(m.device.type == "meta" for m in metrics)  # torchmetrics' own record of it, which update() checks


# ---- the derived config (fast) ----

BASE = dict(stage=2, micro=4, accumulation=2, world=8, clip=1.0, precision="bf16-mixed")


def test_derived_values_fill_the_users_config_and_auto():
    user = {
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"overlap_comm": False},
        "steps_per_print": 50,
    }
    cfg = derive_config(user, **BASE)
    assert cfg["train_batch_size"] == 4 * 2 * 8 == 64  # micro x accumulation x world
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["gradient_accumulation_steps"] == 2
    assert cfg["gradient_clipping"] == 1.0 and cfg["zero_optimization"] == {"overlap_comm": False, "stage": 2}
    assert cfg["steps_per_print"] == 50 and "bf16" not in cfg  # bf16 is then set from trainer.precision
    assert user["zero_optimization"] == {"overlap_comm": False}  # the user's dict is not modified


@pytest.mark.parametrize(
    "user,words",
    [
        ({"train_batch_size": 32}, r"train_batch_size=32 contradicts this run's 64 \(from data.global_batch_size\)"),
        ({"train_micro_batch_size_per_gpu": 8}, "train_micro_batch_size_per_gpu=8 contradicts"),
        ({"gradient_accumulation_steps": 4}, "trainer.accumulate_grad_batches"),
        ({"gradient_clipping": 0.5}, "trainer.gradient_clip_val"),
        ({"zero_optimization": {"stage": 3}}, "stage=3 contradicts trainer.strategy.stage=2"),
        ({"fp16": {"enabled": True}}, "fp16.enabled=true contradicts trainer.precision=bf16-mixed"),
        ({"optimizer": {"type": "Adam"}}, "model.optimizer"),
        ({"scheduler": {"type": "WarmupLR"}}, "model.scheduler"),
    ],
)
def test_contradictions_are_clear_errors(user, words):
    with pytest.raises(ConfigError, match=words):
        derive_config(user, **BASE)


def test_user_json_file_is_read_and_checked(tmp_path):
    good = tmp_path / "ds.json"
    good.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 1000}}))
    assert DeepSpeedStrategy(stage=2, config=str(good)).user_config["zero_optimization"]["reduce_bucket_size"] == 1000
    from omegaconf import OmegaConf  # inline: trainer.strategy.config='{zero_optimization: {reduce_bucket_size: 1000}}'

    inline = DeepSpeedStrategy(stage=2, config=OmegaConf.create({"zero_optimization": {"reduce_bucket_size": 1000}}))
    assert derive_config(inline.user_config, **BASE)["zero_optimization"] == {"reduce_bucket_size": 1000, "stage": 2}
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "zero_optimization": {\n    "stage": 2,\n  }\n}')
    with pytest.raises(ConfigError, match=rf"{bad}:4: not valid JSON"):
        DeepSpeedStrategy(config=str(bad))
    with pytest.raises(ConfigError, match="no such DeepSpeed JSON"):
        DeepSpeedStrategy(config=str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="offload_parameters needs stage=3"):
        DeepSpeedStrategy(stage=2, offload_parameters=True)


def test_lightning_still_hands_the_layer_sync_plugin_to_the_strategy():
    """apply_layer_sync reads Lightning's private `strategy._layer_sync`: fail here if Lightning renames it."""
    import lightning as L

    from src.parallel.fsdp import FSDP2Strategy
    from src.parallel.sync_batchnorm import SyncBatchNorm

    plugin = SyncBatchNorm()
    for strategy in (FSDP2Strategy(), DeepSpeedStrategy(stage=2)):
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, plugins=[plugin], logger=False)
        assert trainer.strategy._layer_sync is plugin


def test_deepspeed_precision_follows_the_hardware():
    """trainer=deepspeed takes the default's precision (bf16 where native, fp16 + loss scaling on V100/T4)."""
    from conftest import ROOT
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["trainer=deepspeed"])
    assert cfg.trainer._get_node("precision")._value() == "${fastest_precision:${trainer.accelerator}}"


# ---- real runs on gloo (slow) ----

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed package: pip install -e '.[deepspeed]'"
)

CPU_DS = [
    "trainer=deepspeed",
    "trainer.strategy._target_=tests.helpers.deepspeed_cpu.CPUDeepSpeedStrategy",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "trainer.precision=32-true",
]


@pytest.fixture
def ddp(reference):
    from test_parity import GPT2_DDP

    return reference(GPT2_DDP)  # trained once per session, shared with test_parity and test_fsdp


def ds_run(tmp: Path, name: str, args: list[str]) -> dict:
    from test_fsdp import last_ckpt, train_sharded
    from test_parity import GPT2

    run = train_sharded(tmp, name, GPT2 + CPU_DS + args)
    run["ckpt"] = last_ckpt(tmp, name)
    return run


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize(  # suite time: ZeRO-1 and ZeRO-2 opt-in (ZeRO-2 stays: the LitModule with accumulation below)
    "stage", [pytest.param(1, marks=[FULL_MATRIX_ONLY]), pytest.param(2, marks=[FULL_MATRIX_ONLY]), 3]
)
def test_zero_stages_match_ddp(tmp_path, ddp, stage):
    from test_parity import assert_same_series, max_param_diff

    from src.checkpoint.convert import is_deepspeed, load_checkpoint

    run = ds_run(tmp_path, f"zero{stage}", [f"trainer.strategy.stage={stage}"])
    assert_same_series(ddp, run, "train/loss", 1e-5)
    assert_same_series(ddp, run, "val/loss", 1e-5)
    assert is_deepspeed(run["ckpt"])
    within(
        max_param_diff(ddp["params"], load_checkpoint(run["ckpt"])["state_dict"]), 1e-5, "params"
    )  # via zero_to_fp32


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.skipif(
    os.environ.get("TEST_CPU_ADAM") != "1",
    reason="JIT-compiles DeepSpeed's CPU Adam (~45 s of both cores of a 2-core machine, 80-100 s of the suite's "
    "10 min): TEST_CPU_ADAM=1 runs it",
)
def test_zero3_with_cpu_offload_uses_deepspeed_cpu_adam_and_matches_ddp(tmp_path, ddp):
    from conftest import path_overrides, run_script
    from test_parity import GPT2, QUIET

    dirs = {"log_dir": tmp_path / "off", "cache_dir": tmp_path / "cache"}
    proc = run_script(
        "train.py",
        QUIET
        + path_overrides(dirs)
        + GPT2
        + CPU_DS
        + [
            "trainer.strategy.stage=3",
            "trainer.strategy.offload_optimizer=true",
            "trainer.strategy.offload_parameters=true",
        ],
    )
    assert "DeepSpeedCPUAdam replaces AdamW" in proc.stdout + proc.stderr
    from test_fsdp import last_ckpt
    from test_parity import max_param_diff

    from src.checkpoint.convert import load_checkpoint

    within(max_param_diff(ddp["params"], load_checkpoint(last_ckpt(tmp_path, "off"))["state_dict"]), 1e-5, "params")


@pytest.mark.slow
@needs_deepspeed
@FULL_MATRIX_ONLY  # suite time: ZeRO-2 = 1 process stays in test_token_loss; ZeRO dirs' resume refusal in test_resume_anywhere
def test_zero2_checkpoint_resumes_exactly_and_exports(tmp_path):
    from test_parity import max_param_diff
    from transformers import AutoModelForCausalLM

    from src.checkpoint.convert import build_module, export_hf, load_checkpoint, read_config

    epoch = ["trainer.limit_train_batches=6", "trainer.val_check_interval=6", "model.scheduler=null"]
    first = ds_run(tmp_path, "first", epoch)
    resumed = ds_run(tmp_path, "resumed", epoch + [f"ckpt_path={first['ckpt']}", "trainer.max_steps=12"])
    straight = ds_run(tmp_path, "straight", epoch + ["trainer.max_steps=12"])
    a, b = load_checkpoint(resumed["ckpt"]), load_checkpoint(straight["ckpt"])
    assert a["global_step"] == b["global_step"] == 12
    assert read_config(straight["ckpt"]) == b["config"]  # from DeepSpeed's client state, no zero_to_fp32
    within(max_param_diff(a["state_dict"], b["state_dict"]), 1e-6, "params")
    hf = AutoModelForCausalLM.from_pretrained(export_hf(straight["ckpt"], tmp_path / "hf")).eval()
    module, _ = build_module(b)
    ids = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        close64(hf.double()(ids).logits, module.double()(ids).logits, "export-hf logits")


@pytest.mark.slow
@needs_deepspeed
def test_zero2_applies_syncbatchnorm_batchnorm_cnn_matches_one_process(tmp_path, reference):
    """Lightning's DeepSpeedStrategy never applies trainer.plugins' LayerSync; ours does, so 3 ranks = 1."""
    from test_fsdp import last_ckpt, train_sharded
    from test_parity import VISION_10_11, assert_same_series, max_param_diff

    from src.checkpoint.convert import load_checkpoint

    one = reference(VISION_10_11)  # shared with test_fsdp
    ds = train_sharded(tmp_path, "ds", VISION_10_11 + CPU_DS + ["trainer.devices=3", "trainer.strategy.stage=2"])
    for tag in ["train/loss", "val/loss", "val/acc", "test/loss", "test/acc"]:
        assert_same_series(one, ds, tag, 1e-5)
    within(max_param_diff(one["params"], load_checkpoint(last_ckpt(tmp_path, "ds"))["state_dict"]), 1e-5, "params")


@pytest.mark.slow
@needs_deepspeed
def test_a_lit_module_under_zero2_with_accumulation_trains_the_ddp_model(tmp_path):
    """ConvNetLitModule returns LitModule.loss_for_backward: under DeepSpeed, which divides the loss by its
    accumulation once more than Lightning, ZeRO-2 with accumulation 2 takes DDP's steps. SGD, whose step is
    proportional to the gradient, unclipped (Adam or clipping by norm would hide a halved one): returning the raw loss
    gave another series (train/loss 2.39 against 3.86 at step 1)."""
    from test_fsdp import train_sharded
    from test_parity import VISION, assert_same_series, train

    args = VISION + [
        "trainer.accumulate_grad_batches=2",
        "model.optimizer._target_=torch.optim.SGD",
        "model.optimizer.lr=0.5",
    ]
    ddp = train(tmp_path, "ddp", args + ["trainer=ddp", "trainer.devices=2"])
    zero2 = train_sharded(tmp_path, "zero2", args + CPU_DS + ["trainer.strategy.stage=2"])
    assert_same_series(ddp, zero2, "train/loss", 1e-5)
