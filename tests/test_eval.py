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


def trained_val_loss(ckpt: Path) -> float:
    """The val/loss training logged last before writing `ckpt`: its val/loss ModelCheckpoint's current score."""
    states = torch.load(ckpt, map_location="cpu", weights_only=False)["callbacks"]
    (score,) = [s["current_score"] for k, s in states.items() if "'monitor': 'val/loss'" in k]
    return float(score)


def test_eval_runs_at_the_checkpoints_precision_unless_given(tmp_path):
    """Trained at the precision this machine would not pick (32-true where it picks bf16-mixed, and vice versa),
    eval.py without trainer.precision reproduces training's last val/loss; trainer.precision= on its command line
    wins, also for a checkpoint moved away from its run; one that holds no precision keeps the machine's default."""
    from src.utils.machine import fastest_precision

    default = fastest_precision()
    trained_at = "32-true" if default != "32-true" else "bf16-mixed"
    quiet = [a for a in QUIET if not a.startswith("trainer.precision=")]
    run_script(
        "train.py",
        quiet
        + path_overrides({"log_dir": tmp_path / "train", "cache_dir": tmp_path / "cache"})
        + GPT2
        + SHORT
        + [f"trainer.precision={trained_at}", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2"],
    )
    (run,) = (tmp_path / "train" / "train" / "runs").iterdir()
    ckpt = run / "checkpoints" / "last.ckpt"
    expected = trained_val_loss(ckpt)
    limits = ["trainer.limit_val_batches=2", "trainer.limit_test_batches=2"]

    same, out = evaluate(tmp_path, ckpt, limits)
    within(abs(same["val/loss"] - expected), 1e-6, f"val/loss at {trained_at}: eval {same['val/loss']} vs trained")
    assert f"Evaluating at trainer.precision={trained_at}, the precision the checkpoint trained at" in out

    told, out = evaluate(tmp_path, ckpt, [*limits, f"trainer.precision={default}"])
    assert f"Evaluating at trainer.precision={default}: given on the command line" in out
    assert f"the checkpoint trained at {trained_at}" in out
    assert abs(told["val/loss"] - expected) > 1e-6, (told, expected)  # the other precision really ran

    moved = tmp_path / "elsewhere" / "moved.ckpt"  # away from its run: the precision is in the checkpoint itself
    moved.parent.mkdir()
    moved.write_bytes(ckpt.read_bytes())
    again, out = evaluate(tmp_path, moved, limits)
    assert again["val/loss"] == same["val/loss"]
    older = torch.load(moved, map_location="cpu", weights_only=False)  # as written before the precision was stored
    del older["config"]["trainer"]
    torch.save(older, moved)
    unknown, out = evaluate(tmp_path, moved, limits)
    assert f"Evaluating at trainer.precision={default}, this machine's default" in out
    assert unknown["val/loss"] == told["val/loss"]
