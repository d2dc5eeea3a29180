"""A run that diverges stops, naming the step and the last good checkpoint, and never overwrites a
checkpoint with NaN weights (src/callbacks/divergence.py); NaN validation losses are logged, and the
sample generation does not crash on a NaN model.

Real train.py runs: tests/helpers/divergence.py sets one weight to NaN before a given step.
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path
from typing import Optional

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from src.callbacks.divergence import Divergence, DivergenceError
from src.core.module import LitModule
from tests.conftest import ROOT, python, read_events, run_script
from tests.helpers.divergence import InjectNaN
from tests.test_parity import GPT2, QUIET

NAN_AT = ["+callbacks.nan._target_=tests.helpers.divergence.InjectNaN"]


def job(tmp_path: Path, *extra: str, generate: bool = False) -> list[str]:
    quiet = [a for a in QUIET if not (generate and a.startswith("callbacks.generate_text"))]
    return [
        *quiet,
        *GPT2,
        "trainer.max_steps=12",
        f"hydra.run.dir={tmp_path / 'run'}",
        f"paths.cache_dir={tmp_path / 'cache'}",
        *NAN_AT,
        *extra,
    ]


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def all_finite(state: dict) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point())


def output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_nan_weights_are_never_saved_and_the_run_stops(tmp_path):
    """last.ckpt is written after every step; step 6 makes the weights NaN and is never logged
    (log_every_n_steps=50): the save after it is vetoed and the run stops, last.ckpt = the state after step 5."""
    proc = run_script(
        "train.py",
        job(
            tmp_path,
            "+callbacks.nan.step=6",
            "trainer.log_every_n_steps=50",
            "trainer.val_check_interval=4",
            "callbacks.last_checkpoint.every_n_train_steps=1",
        ),
        check=False,
    )
    out, ckpts = output(proc), tmp_path / "run" / "checkpoints"
    assert proc.returncode != 0, out[-3000:]
    assert "Training diverged at step 6" in out and "first non-finite train loss at step 6" in out, out[-3000:]
    assert f"The last good checkpoint: {ckpts / 'last.ckpt'} (saved at step 5)" in out, out[-3000:]
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step_000004.ckpt"]
    last, before = load(ckpts / "last.ckpt"), load(tmp_path / "run" / "before_nan.pt")
    assert last["global_step"] == before["global_step"] == 5
    assert all_finite(last["state_dict"]) and all_finite(load(ckpts / "step_000004.ckpt")["state_dict"])
    for name, value in before["state_dict"].items():
        assert torch.equal(last["state_dict"][name], value), name


@pytest.mark.slow
def test_nan_validation_loss_is_logged_and_stops_the_run(tmp_path):
    """Step 6 makes the weights NaN; no train loss is logged before validation at step 8, which sees
    val/loss = NaN: it is in TensorBoard, the sample generation warns instead of crashing, the run
    stops naming last.ckpt from step 4."""
    proc = run_script(
        "train.py",
        job(
            tmp_path,
            "+callbacks.nan.step=6",
            "trainer.log_every_n_steps=50",
            "trainer.val_check_interval=4",
            "callbacks.generate_text.max_new_tokens=4",
            "callbacks.generate_text.prompts=[a]",
            generate=True,
        ),
        check=False,
    )
    out, run = output(proc), tmp_path / "run"
    assert proc.returncode != 0, out[-3000:]
    assert "probability tensor" not in out, out[-3000:]
    assert "logits are not finite" in out, out[-3000:]
    assert "Training diverged at step 8: val/loss=nan" in out, out[-3000:]
    assert f"The last good checkpoint: {run / 'checkpoints'}" in out and "(saved at step 4)" in out, out[-3000:]
    val = [e.value for e in read_events(run / "tensorboard").Scalars("val/loss")]  # after steps 4 and 8
    assert len(val) == 2 and math.isfinite(val[0]) and math.isnan(val[1]), val
    last = load(run / "checkpoints" / "last.ckpt")
    assert last["global_step"] == 4 and all_finite(last["state_dict"])


@pytest.mark.slow
def test_two_ranks_stop_together(tmp_path):
    """Rank 1 alone has a NaN weight before step 3: its loss is NaN, rank 0's is not. The flag in the
    train-loss all-reduce (log_every_n_steps=1) stops both ranks at step 3, within the time limit."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    args = job(
        tmp_path,
        "trainer=ddp",
        "trainer.devices=2",
        "trainer.strategy.timeout.minutes=2",
        "+callbacks.nan.step=3",
        "+callbacks.nan.rank=1",
        "trainer.val_check_interval=2",
    )
    try:
        proc = subprocess.run(
            [python(), "train.py", *args],
            cwd=ROOT,
            env={**env, "PYTHONUNBUFFERED": "1"},
            capture_output=True,
            text=True,
            timeout=240,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the 2-rank job hung:\n{str(e.stdout)[-3000:]}")
    out, ckpts = output(proc), tmp_path / "run" / "checkpoints"
    assert proc.returncode != 0, out[-3000:]
    # both ranks decided to stop: neither was left waiting for the other until the collective timeout
    assert "timed out" not in out and "another rank exited" not in out, out[-3000:]
    assert (
        "Training diverged at step 3: the train loss was not finite (first non-finite train loss at step 3)" in out
    ), out[-3000:]
    assert f"The last good checkpoint: {ckpts / 'last.ckpt'} (saved at step 2)" in out, out[-3000:]
    last = load(ckpts / "last.ckpt")
    assert last["global_step"] == 2 and all_finite(last["state_dict"])
    assert not list(ckpts.glob("*.tmp"))


class Tiny(LitModule):
    """The smallest LitModule: a linear regression trained with fused AdamW, logging through log_train_loss."""

    def __init__(self) -> None:
        super().__init__(optimizer=None, scheduler=None, weight_decay=0.0, lr_scaling="none", base_batch_size=4)
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log_train_loss(loss, batch_idx)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.1, fused=True)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), batch_size=4)


def fit(tmp_path: Path, action: str, fault: Optional[L.Callback] = None, **kwargs) -> tuple[L.Trainer, Tiny]:
    """6 steps; step 3's loss and gradients are NaN (a bad batch), its weights are not; or another `fault`.
    `kwargs`: other Trainer arguments."""
    model = Tiny()
    trainer = L.Trainer(
        **{
            "max_steps": 6,
            "log_every_n_steps": 2,
            "callbacks": [Divergence(action), fault or InjectNaN(3, restore=True)],
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "accelerator": "cpu",
            "devices": 1,
            "default_root_dir": tmp_path,
            **kwargs,
        }
    )
    trainer.fit(model)
    return trainer, model


def test_skip_leaves_out_the_non_finite_step_on_the_device(tmp_path):
    """action=skip: the fused AdamW skips step 3's update (state and step count untouched); training goes on."""
    trainer, model = fit(tmp_path, "skip")
    before, after = load(tmp_path / "before_nan.pt"), load(tmp_path / "after_nan.pt")
    assert (before["global_step"], after["global_step"], trainer.global_step) == (2, 3, 6)
    for name, value in before["state_dict"].items():
        assert torch.equal(after["state_dict"][name], value), name
    assert all_finite(model.state_dict())
    assert {int(s["step"]) for s in trainer.optimizers[0].state.values()} == {5}  # 6 steps, one skipped
    assert int(next(c for c in trainer.callbacks if isinstance(c, Divergence)).skipped) == 1


def test_stop_at_the_next_logging_step(tmp_path):
    """action=stop: the flag reaches the host with the loss of logging step 4 and names step 3."""
    with pytest.raises(
        DivergenceError,
        match=r"at step 4: the train loss was not finite \(first non-finite train "
        r"loss at step 3\)",
    ):
        fit(tmp_path, "stop")


def test_fp16_loss_scaling_skips_an_overflow_step_logs_it_and_the_scale_recovers(tmp_path, caplog):
    """trainer.precision=16-mixed's GradScaler (Lightning's MixedPrecision, here on the CPU with torch's CPU
    GradScaler: the template refuses fp16 on a CPU, tests/test_gpu.py runs it through train.py on CUDA): step 3's
    gradients overflow (one inf, the loss finite). The update is skipped (weights and Adam's count untouched), the
    scale halves, train/skipped_updates reads 1 from step 3 on and the scale doubles back after growth_interval=2
    good steps; one console line says so."""
    import csv
    import logging

    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.plugins.precision import MixedPrecision

    from tests.helpers.divergence import InfGradient

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    caplog.set_level(logging.INFO, logger="src.callbacks.divergence")
    fp16 = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    trainer, _ = fit(tmp_path, "stop", InfGradient(3), log_every_n_steps=1, plugins=[fp16], logger=CSVLogger(tmp_path))
    before, after = load(tmp_path / "before_inf.pt"), load(tmp_path / "after_inf.pt")
    assert (before["global_step"], after["global_step"], trainer.global_step) == (2, 3, 6)
    for name, value in before["state_dict"].items():
        assert torch.equal(after["state_dict"][name], value), name
    assert {int(s["step"]) for s in trainer.optimizers[0].state.values()} == {5}
    (path,) = tmp_path.rglob("metrics.csv")
    rows = [r for r in csv.DictReader(open(path)) if r.get("train/loss_scale")]
    scale = [float(r["train/loss_scale"]) for r in rows]
    skipped = [float(r["train/skipped_updates"]) for r in rows]
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3, 4, 5]  # each at its step's train/loss
    assert scale == [256.0, 512.0, 256.0, 256.0, 512.0, 512.0] and skipped == [0, 0, 1, 1, 1, 1], (scale, skipped)
    (line,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert "1 optimizer update(s) skipped by step 3" in line and "loss scale is now 256" in line, line
