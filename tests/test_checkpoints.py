"""Checkpoints a kill cannot half-write, resume=auto past a damaged last.ckpt, and one resume decision for all ranks."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import FULL_MATRIX_ONLY, ROOT, gone, python, run_script
from test_parity import GPT2, QUIET, max_param_diff

from src.checkpoint.convert import load_checkpoint
from src.checkpoint.files import AtomicCheckpointIO, problem, recover
from src.checkpoint.latest import decide_resume
from src.utils.config import ConfigError
from tests.helpers import forkrun
from tests.helpers.margins import within

FSDP = ["trainer=fsdp", "trainer.devices=2"]


def base(tmp: Path) -> list[str]:
    return QUIET + [f"paths.cache_dir={tmp / 'cache'}"] + GPT2


# ---- single-file checkpoints and the reading side (one process) ----


def test_atomic_file_save_keeps_the_old_file_until_the_new_one_is_complete(tmp_path):
    """A save that dies while writing leaves the previous checkpoint whole and only a .tmp beside it."""
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 3}, path)

    class Boom:
        def __reduce__(self):
            raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="killed mid-write"):
        io.save_checkpoint({"global_step": 6, "x": torch.zeros(1000), "boom": Boom()}, path)
    assert torch.load(path, weights_only=False)["global_step"] == 3 and problem(path) is None
    recover(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # the partial .tmp is gone


def test_recover_puts_the_previous_sharded_dir_back_after_a_kill_between_the_renames(tmp_path):
    path, old, tmp = tmp_path / "last.ckpt", tmp_path / "last.ckpt.old", tmp_path / "last.ckpt.tmp"
    old.mkdir()
    (old / "meta.pt").write_text("previous")
    tmp.mkdir()
    recover(path)
    assert (path / "meta.pt").read_text() == "previous" and not old.exists() and not tmp.exists()


@pytest.mark.slow
def test_resume_auto_falls_back_from_a_truncated_or_foreign_last_ckpt(tmp_path):
    """A real run leaves its best step_*.ckpt and last.ckpt; last.ckpt cut in half or replaced by text is
    skipped with one log line and the run continues from the best one; with nothing readable, one sentence."""
    run_dir = tmp_path / "run"
    args = base(tmp_path) + [
        "trainer.max_steps=8",
        "trainer.val_check_interval=4",
        "resume=auto",
        f"hydra.run.dir={run_dir}",
    ]
    run_script("train.py", args)
    ckpts = run_dir / "checkpoints"
    last, (best,) = ckpts / "last.ckpt", ckpts.glob("step_*.ckpt")  # the best of steps 4 and 8
    assert problem(last) is None and problem(best) is None
    original = last.read_bytes()

    last.write_text("not a checkpoint\n")  # a foreign file
    assert "not a checkpoint" in problem(last) and decide_resume(ckpts) == str(best)

    last.write_bytes(original[: len(original) // 2])  # cut in half
    assert "truncated" in problem(last)
    resumed = run_script("train.py", args + ["trainer.max_steps=12"])
    out = resumed.stdout + resumed.stderr
    assert f"resume=auto: {last} cannot be resumed from (it is truncated" in out
    assert f"continuing from {best}" in out
    assert torch.load(last, weights_only=False)["global_step"] == 12  # it went on from the best checkpoint

    for ckpt in ckpts.glob("*.ckpt"):
        ckpt.write_bytes(ckpt.read_bytes()[:100])
    with pytest.raises(ConfigError, match=r"no other checkpoint in .* is complete; delete .* or pass ckpt_path="):
        decide_resume(ckpts)
    failed = run_script("train.py", args, check=False)
    assert failed.returncode != 0 and "cannot be resumed from" in failed.stderr


@pytest.mark.parametrize("trainer", ["default", "ddp", "fsdp"])
def test_every_trainer_writes_single_files_through_the_atomic_io(trainer, tmp_path):
    """trainer.plugins' AtomicCheckpointIO reaches the strategy Lightning builds (DDP, 1 device, and FSDP2's
    save_distributed_checkpoint=false file), and FSDP2's sharded save is our rename-into-place one."""
    from hydra.utils import instantiate
    from test_configs import compose_cfg

    from src.parallel.fsdp import FSDP2Strategy

    cfg = compose_cfg([f"trainer={trainer}", "trainer.accelerator=cpu"], tmp=tmp_path)
    strategy = instantiate(cfg.trainer, logger=False).strategy
    assert isinstance(strategy.checkpoint_io, AtomicCheckpointIO)
    if trainer == "fsdp":
        assert type(strategy).save_checkpoint is FSDP2Strategy.save_checkpoint


# ---- sharded checkpoints: a kill in the middle of a save (2 gloo processes) ----


def wait_for(paths: list[Path], proc: subprocess.Popen, timeout: float = 300) -> None:
    end = time.time() + timeout
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, f"run ended (rc {proc.returncode}) before the save to kill"
        assert time.time() < end, "the stalled save never started"
        time.sleep(0.2)


KILLS = {  # strategy -> its overrides and the test callback that stalls its save at step 6
    "fsdp": (FSDP, "StallShardedSave"),
    "deepspeed": (
        [
            "trainer=deepspeed",
            "trainer.strategy._target_=tests.helpers.deepspeed_cpu.CPUDeepSpeedStrategy",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
            "trainer.strategy.stage=2",
            "model.scheduler=null",
        ],
        "StallDeepSpeedSave",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize(  # suite time: DeepSpeed's save goes through the same save_sharded as FSDP2's, whose case stays
    "strategy", [pytest.param(s, marks=[FULL_MATRIX_ONLY] if s == "deepspeed" else []) for s in KILLS]
)
def test_kill_during_a_sharded_save_resumes_from_the_last_complete_checkpoint(strategy, tmp_path):
    """SIGKILL to the whole process group in the middle of the step-6 save of last.ckpt (FSDP2: both ranks'
    shards written, not the .metadata; DeepSpeed: model states written, not the ZeRO partitions): resume=auto in
    the same dir goes on from the complete step-3 checkpoint and ends with the parameters of a run never killed.
    Before atomic saves, step-6 files sat beside step-3 ones in last.ckpt and the resumed run mixed the two."""
    if strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    overrides, stall = KILLS[strategy]
    run = [
        "trainer.max_steps=9",
        "trainer.limit_train_batches=3",
        "trainer.val_check_interval=9",
        "callbacks.last_checkpoint.every_n_train_steps=3",
        "resume=auto",
    ]
    args = base(tmp_path) + overrides + run
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1", **forkrun.DIE_WITH_PARENT}
    stall = [f"+callbacks.stall._target_=tests.helpers.checkpoint_faults.{stall}", "+callbacks.stall.step=6"]
    proc = subprocess.Popen(
        [python(), "train.py", *args, f"hydra.run.dir={killed}", *stall],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    markers = [killed / "saving_rank0", killed / "saving_rank1"]  # each holds its rank's pid
    try:
        wait_for(markers, proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for marker in markers:  # both ranks are gone before anything reads the checkpoint dir
        assert gone(int(marker.read_text())), f"{marker.name}: the rank outlived the kill"
    last = killed / "checkpoints" / "last.ckpt"
    assert problem(last) is None and load_checkpoint(last)["global_step"] == 3  # still the complete step-3 one

    second = run_script("train.py", args + [f"hydra.run.dir={killed}"])
    assert f"resume=auto: continuing from {last}" in second.stdout + second.stderr
    run_script("train.py", args + [f"hydra.run.dir={straight}"])
    resumed, uninterrupted = load_checkpoint(last), load_checkpoint(straight / "checkpoints" / "last.ckpt")
    assert resumed["global_step"] == uninterrupted["global_step"] == 9
    within(max_param_diff(resumed["state_dict"], uninterrupted["state_dict"]), 1e-6, "params")
    assert sorted(p.name for p in last.parent.iterdir()) == sorted(p.name for p in (straight / "checkpoints").iterdir())

    # a shard cut in half (a copy gone wrong): resume=auto falls back to the best checkpoint, a complete dir
    shard = next(last.glob("__1_*.distcp") if strategy == "fsdp" else last.glob("checkpoint/*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert "truncated" in problem(last) and decide_resume(last.parent) == str(last.parent / "step_000009.ckpt")


# ---- one resume decision: rank 0's ----


@pytest.mark.slow
def test_resume_auto_is_decided_by_rank_0_for_every_rank(tmp_path):
    """Rank 1 is made to see no checkpoint (a shared file system lagging behind); it still resumes from rank 0's
    choice, step 6, instead of starting from scratch beside a resumed rank 0."""
    run_dir = tmp_path / "run"
    args = base(tmp_path) + [
        "trainer=ddp",
        "trainer.devices=2",
        "resume=auto",
        f"hydra.run.dir={run_dir}",
        "+callbacks.start._target_=tests.helpers.checkpoint_faults.RecordStartStep",
    ]
    run_script("train.py", args)
    hide = ["+callbacks.hide._target_=tests.helpers.checkpoint_faults.HideCheckpointsOnRank", "trainer.max_steps=12"]
    run_script("train.py", args + hide, timeout=300)
    assert [(run_dir / f"start_step_rank{r}").read_text() for r in (0, 1)] == ["6", "6"]
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 12


def torchrun_two_nodes(tmp: Path, args: list[str]) -> list[str]:
    """2 "nodes" x 1 process on localhost, each with its own run dir (as if each node saw its own file system)."""
    from conftest import free_port

    port, procs = free_port(), []
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHON_EXEC": python()}  # torchrun starts its ranks with it
    for node in (0, 1):
        run = [
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=resume",
            f"--node-rank={node}",
            "train.py",
            "trainer=ddp",
            f"hydra.run.dir={tmp / f'node{node}'}",
        ]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", *run, *args],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    return outs


@FULL_MATRIX_ONLY  # suite time, 17 s: resume=auto decided by rank 0 for every rank stays (this file, Lightning's launcher)
@pytest.mark.slow
def test_resume_auto_under_torchrun_is_rank_0s_decision(tmp_path):
    """Under torchrun every rank starts train.py itself. Only rank 0 (node 0) has the checkpoint in its view; rank 1
    (node 1, nothing there) still resumes from rank 0's choice instead of starting from scratch beside it."""
    args = base(tmp_path) + ["resume=auto", "+callbacks.start._target_=tests.helpers.checkpoint_faults.RecordStartStep"]
    torchrun_two_nodes(tmp_path, args)
    assert (tmp_path / "node0" / "checkpoints" / "last.ckpt").is_file()
    assert not (tmp_path / "node1" / "checkpoints").exists()
    torchrun_two_nodes(tmp_path, args + ["trainer.max_steps=12"])
    assert [(tmp_path / f"node{r}" / f"start_step_rank{r}").read_text() for r in (0, 1)] == ["6", "6"]
