"""eval.py as a user runs it after training: on any number of ranks, on sharded checkpoints, from any dir."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import ROOT, path_overrides, python, run_script, shared
from test_parity import GPT2, QUIET

from src.checkpoint.convert import load_checkpoint, read_config
from tests.helpers.margins import within

pytestmark = pytest.mark.slow
SHORT = ["trainer.max_steps=2", "trainer.val_check_interval=2"]


def train_run(tmp: Path, name: str, args: list[str]) -> Path:
    """A short training run; its last checkpoint."""
    run_script("train.py", QUIET + path_overrides({"log_dir": tmp / name, "cache_dir": tmp / "cache"}) + args)
    (run,) = (tmp / name / "train" / "runs").iterdir()
    return run / "checkpoints" / "last.ckpt"


def evaluate(tmp: Path, ckpt: Path, args: list[str]) -> tuple[dict[str, float], str]:
    proc = run_script(
        "eval.py",
        [f"ckpt_path={ckpt}", *QUIET[:3], f"paths.log_dir={tmp / 'eval'}", f"paths.cache_dir={tmp / 'cache'}", *args],
    )
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("EVAL "))
    return {k: float(v) for k, v in (kv.split("=") for kv in line[5:].split())}, proc.stdout + proc.stderr


def test_eval_on_three_ranks_needs_no_divisible_global_batch_and_matches_one(tmp_path):
    """Global batch 8 does not divide over 3 ranks; evaluating has no optimizer step, so it must not matter."""
    ckpt = train_run(tmp_path, "train", GPT2 + SHORT)
    one, _ = evaluate(tmp_path, ckpt, [])
    three, _ = evaluate(tmp_path, ckpt, ["trainer=ddp", "trainer.devices=3"])
    assert one.keys() == three.keys() and {"val/loss", "test/loss"} <= one.keys()
    for key in one:
        within(abs(three[key] - one[key]), 1e-5 + 1e-5 * abs(one[key]), key)


def test_sharded_checkpoint_config_read_without_gathering_and_consolidated_once(tmp_path, fsdp_checkpoint):
    ckpt = fsdp_checkpoint  # GPT2 + SHORT on 2 FSDP2 ranks, trained once per session (shared with test_fsdp)
    assert read_config(ckpt) == load_checkpoint(ckpt)["config"]  # from meta.pt alone
    one, _ = evaluate(tmp_path, ckpt, [])
    two, out = evaluate(tmp_path, ckpt, ["trainer=ddp", "trainer.devices=2"])
    assert out.count("Consolidating ") == 1  # by one rank; the other reuses its file
    for key in one:
        within(abs(two[key] - one[key]), 1e-5 + 1e-5 * abs(one[key]), key)
    files = sorted((tmp_path / "eval").rglob("consolidated.ckpt"))
    assert len(files) == 2  # one per eval run, shared by that run's ranks
    state = torch.load(files[-1], weights_only=False)
    assert "optimizer_0" not in state and "optimizer_states" not in state  # the weights, not Adam's moments
    assert not list((tmp_path / "eval").rglob("*.tmp*"))


def test_paths_typed_relative_are_stored_absolute(tmp_path):
    """Trained with relative paths from the project dir; export-hf and eval.py then work from anywhere."""
    rel_model = os.path.relpath(shared("tiny-gpt2"), ROOT)
    rel_data = os.path.relpath(shared("tinyshakespeare", "input.txt"), ROOT)
    assert not Path(rel_model).is_absolute()
    ckpt = train_run(
        tmp_path,
        "ft",
        SHORT
        + [
            f"model.pretrained={rel_model}",
            f"data.path={rel_data}",
            "data.seq_len=32",
            "data.global_batch_size=4",
            "test=false",
            "trainer.limit_val_batches=2",
        ],
    )
    config = read_config(ckpt)
    assert config["model"]["pretrained"] == str(shared("tiny-gpt2").resolve())
    assert config["data"]["path"] == str(shared("tinyshakespeare", "input.txt").resolve())
    assert config["data"]["tokenizer"] == config["model"]["pretrained"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    export = subprocess.run(
        [python(), "-m", "src.tools.checkpoints", "export-hf", str(ckpt), "hf"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert export.returncode == 0, export.stderr[-3000:]
    assert (elsewhere / "hf" / "model.safetensors").is_file() and (elsewhere / "hf" / "tokenizer.json").is_file()
    evaluation = subprocess.run(
        [
            python(),
            str(ROOT / "eval.py"),
            f"ckpt_path={ckpt}",
            *QUIET[:3],
            f"paths.log_dir={tmp_path / 'eval'}",
            "trainer.limit_val_batches=2",
            "trainer.limit_test_batches=2",
        ],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
    assert "EVAL " in evaluation.stdout
