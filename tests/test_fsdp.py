"""trainer=fsdp (FSDP2 on gloo): parity with DDP, sharded checkpoints that resume and consolidate,
Hugging Face export, and the memory estimate against bytes measured per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FULL_MATRIX_ONLY, path_overrides, run_script
from test_parity import GPT2, GPT2_DDP, QUIET, VISION_10_11, assert_same_series, max_param_diff

from src.checkpoint.convert import build_module, export_hf, is_sharded, load_checkpoint
from src.tools.memory import estimate, gpt2_params, model_states
from tests.helpers.margins import close64, within

pytestmark = pytest.mark.slow
FSDP = ["trainer=fsdp", "trainer.devices=2"]


def last_ckpt(tmp: Path, name: str) -> Path:
    (run,) = (tmp / name / "train" / "runs").iterdir()
    return run / "checkpoints" / "last.ckpt"


def params_of(ckpt: Path) -> dict:
    return load_checkpoint(ckpt)["state_dict"]


def test_fsdp_matches_ddp_and_its_sharded_checkpoint_consolidates(tmp_path, reference):
    ddp = reference(GPT2_DDP)
    fsdp = train_sharded(tmp_path, "fsdp", GPT2 + FSDP)
    assert_same_series(ddp, fsdp, "train/loss", 1e-5)
    assert_same_series(ddp, fsdp, "val/loss", 1e-5)
    ckpt = last_ckpt(tmp_path, "fsdp")
    assert is_sharded(ckpt) and len(list(ckpt.glob("__*_0.distcp"))) == 2  # one shard file per rank
    within(max_param_diff(ddp["params"], params_of(ckpt)), 1e-5, "params")


def train_sharded(tmp: Path, name: str, args: list[str]) -> dict:
    """Like test_parity.train, for runs whose checkpoint is a sharded dir."""
    from conftest import read_events

    dirs = {"log_dir": tmp / name, "cache_dir": tmp / "cache"}
    run_script("train.py", QUIET + path_overrides(dirs) + args)
    (run,) = (dirs["log_dir"] / "train" / "runs").iterdir()
    ea = read_events(run / "tensorboard")
    return {"scalars": {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}}


def test_sharded_checkpoint_resumes_exactly(tmp_path):
    """6 steps, save shards, resume to 12 == 12 steps straight (epochs of 6 steps: the resume is at a boundary)."""
    # constant LR: a cosine schedule's length depends on max_steps, which the resumed run changes
    epoch = ["trainer.limit_train_batches=6", "trainer.val_check_interval=6", "model.scheduler=null"]
    train_sharded(tmp_path, "first", GPT2 + FSDP + epoch)
    resume = [f"ckpt_path={last_ckpt(tmp_path, 'first')}", "trainer.max_steps=12"]
    train_sharded(tmp_path, "resumed", GPT2 + FSDP + epoch + resume)
    train_sharded(tmp_path, "straight", GPT2 + FSDP + epoch + ["trainer.max_steps=12"])
    resumed, straight = (
        load_checkpoint(last_ckpt(tmp_path, "resumed")),
        load_checkpoint(last_ckpt(tmp_path, "straight")),
    )
    assert resumed["global_step"] == straight["global_step"] == 12
    within(max_param_diff(resumed["state_dict"], straight["state_dict"]), 1e-6, "params")


def test_export_hf_from_a_sharded_checkpoint_gives_the_same_logits(tmp_path, fsdp_checkpoint):
    from transformers import AutoModelForCausalLM

    ckpt = fsdp_checkpoint  # 2 steps of GPT2 + FSDP, shared with test_eval
    out = export_hf(ckpt, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    module, _ = build_module(load_checkpoint(ckpt))
    ids = torch.randint(0, 257, (2, 32))
    with torch.no_grad():
        close64(hf.double()(ids).logits, module.double()(ids).logits, "export-hf logits")
    # the command-line form
    proc = run_script("-m", ["src.tools.checkpoints", "consolidate", str(ckpt), str(tmp_path / "one.ckpt")])
    assert Path(proc.stdout.strip()).is_file()
    assert (
        max_param_diff(torch.load(tmp_path / "one.ckpt", weights_only=False)["state_dict"], module.state_dict()) == 0.0
    )


# ---- memory estimate ----


def test_estimate_formulas():
    psi = 1_000_000
    assert sum(model_states(psi, 1, "ddp", mixed=True)[:3]) == 16 * psi
    assert sum(model_states(psi, 8, "zero1", mixed=True)[:3]) == 4 * psi + 12 * psi / 8
    assert sum(model_states(psi, 8, "zero2", mixed=True)[:3]) == 2 * psi + 14 * psi / 8
    assert sum(model_states(psi, 8, "zero3", mixed=True)[:3]) == 16 * psi / 8
    p, g, o, cpu = model_states(psi, 8, "zero3", mixed=True, offload_optimizer=True, offload_param=True)
    assert (p, o) == (0, 0) and cpu == 2 * psi / 8 + 12 * psi / 8
    assert gpt2_params(12, 768) == 124_439_808  # GPT-2 small, as in test_configs
    with pytest.raises(ValueError, match="offload_param needs zero3"):
        model_states(psi, 8, "zero2", mixed=True, offload_param=True)
    e = estimate("small", 8, "zero2", checkpointing=True)
    assert e.activations < estimate("small", 8, "zero2").activations


@pytest.mark.parametrize("strategy,trainer", [("ddp", ["trainer=ddp"]), ("zero3", FSDP)])
def test_estimate_matches_bytes_measured_per_rank(tmp_path, strategy, trainer):
    """fp32 Adam, 2 ranks: DDP holds 16 bytes/param per rank, FSDP2 full shard 16/2 (plus shard padding)."""
    dirs = {"log_dir": tmp_path / "logs", "cache_dir": tmp_path / "cache"}
    run_script(
        "train.py",
        QUIET
        + path_overrides(dirs)
        + GPT2
        + trainer
        + [
            "trainer.devices=2",
            "trainer.max_steps=3",
            "trainer.val_check_interval=3",
            "+callbacks.state_bytes._target_=tests.helpers.callbacks.RecordStateBytes",
        ],
    )
    (run,) = (dirs["log_dir"] / "train" / "runs").iterdir()
    module, _ = build_module(load_checkpoint(run / "checkpoints" / "last.ckpt"))
    psi = sum(p.numel() for p in module.parameters())
    expected = model_states(psi, 2, strategy, mixed=False)[:3]
    measured = [json.loads((run / f"state_bytes_rank{rank}.json").read_text()) for rank in (0, 1)]
    for kind, want in zip(("params", "grads", "optimizer"), expected):
        for rank in (0, 1):  # FSDP's dim-0 shards differ by a row or so between ranks
            assert abs(measured[rank][kind] - want) <= 0.02 * want, (kind, rank, measured, expected)
        # DDP: two full copies; FSDP: the two shards add up to exactly one copy
        assert measured[0][kind] + measured[1][kind] == 2 * want


def test_fsdp_batchnorm_cnn_matches_one_process(tmp_path, reference):
    """SyncBatchNorm applies under FSDP too (Lightning only applies trainer.plugins' LayerSync for DDP)."""
    one = reference(VISION_10_11)
    fsdp = train_sharded(tmp_path, "fsdp", VISION_10_11 + FSDP)
    for tag in ["train/loss", "val/loss", "val/acc", "test/loss", "test/acc"]:
        assert_same_series(one, fsdp, tag, 1e-5)
    within(max_param_diff(one["params"], params_of(last_ckpt(tmp_path, "fsdp"))), 1e-5, "params")


@FULL_MATRIX_ONLY  # suite time: FSDP2's default = DDP stays in the suite
def test_fsdp_switches(tmp_path, reference):
    """Activation checkpointing recomputes the same numbers; bf16 params stay close to fp32; ZeRO-2-like too."""
    ddp = reference(GPT2_DDP)
    ac = train_sharded(
        tmp_path,
        "ac",
        GPT2
        + FSDP
        + ["model.gradient_checkpointing=true", "model.compile=true", "trainer.strategy.reshard_after_forward=false"],
    )
    assert_same_series(ddp, ac, "train/loss", 1e-5)
    within(max_param_diff(ddp["params"], params_of(last_ckpt(tmp_path, "ac"))), 1e-5, "params")
    bf16 = train_sharded(
        tmp_path,
        "bf16",
        GPT2 + FSDP + ["trainer.strategy.param_dtype=bfloat16", "trainer.strategy.reduce_dtype=float32"],
    )
    assert_same_series(ddp, bf16, "train/loss", 2e-2)  # bf16 has ~3 significant digits
    state = params_of(last_ckpt(tmp_path, "bf16"))
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())  # fp32 master weights
