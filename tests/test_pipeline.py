"""trainer=pipeline (torch.distributed.pipelining on gloo) against one process, number for number:
losses at every step, validation, final parameters, resume, export; and the checks before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import path_overrides, read_events, run_script
from src.tools.checkpoints import load_checkpoint
from test_parity import GPT2, QUIET, assert_same_series, max_param_diff, train

# 4 blocks: 2 stages of 2, or 4 stages of 1 for the interleaved schedule; a cosine schedule with warm-up,
# clipping by the whole model's norm at a value that does clip (the early gradient norms are above 0.5)
PIPE_GPT2 = GPT2 + ["model.n_layer=4", "trainer.gradient_clip_val=0.5"]
PIPELINE = ["trainer=pipeline", "trainer.devices=2", "trainer.gradient_clip_val=null",
            "trainer.strategy.gradient_clip_val=0.5"]


def run_dir(tmp: Path, name: str) -> Path:
    (run,) = (tmp / name / "train" / "runs").iterdir()
    return run


def train_pipeline(tmp: Path, name: str, args: list[str]) -> dict:
    """A pipeline run: its TensorBoard scalars (rank 0's file) and its DCP checkpoint's weights, all stages joined."""
    dirs = {"log_dir": tmp / name, "cache_dir": tmp / "cache"}
    run_script("train.py", QUIET + path_overrides(dirs) + args)
    run = run_dir(tmp, name)
    ea = read_events(run / "tensorboard")
    scalars = {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}
    return {"scalars": scalars, "params": load_checkpoint(run / "checkpoints" / "last.ckpt")["state_dict"]}


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("schedule", [
    ["trainer.strategy.schedule=GPipe"],
    ["trainer.strategy.schedule=1F1B"],
    ["trainer.strategy.schedule=Interleaved1F1B", "trainer.strategy.stages_per_rank=2"],
], ids=["GPipe", "1F1B", "Interleaved1F1B"])
def test_pipeline_schedules_match_one_process(tmp_path, schedule):
    """2 ranks, 4 micro-batches: train loss at every step, val loss (52 samples in batches of 8: a short last batch) and
    final parameters equal one process's, with the tied wte/lm_head, clipping and an LR schedule."""
    one = train(tmp_path, "one", PIPE_GPT2)
    pipe = train_pipeline(tmp_path, "pipe", PIPE_GPT2 + PIPELINE + schedule)
    assert_same_series(one, pipe, "train/loss", 1e-5)
    assert_same_series(one, pipe, "val/loss", 1e-5)
    assert len(pipe["scalars"]["train/loss"]) == 6
    assert max_param_diff(one["params"], pipe["params"]) <= 1e-5
