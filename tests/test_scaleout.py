"""Sweeps and scale-out: DDP inside multirun, failing jobs, Optuna, SLURM via submitit, multi-node torchrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, event_file_pid, event_files, free_port, path_overrides, python, read_events, run_script
from test_parity import GPT2, QUIET, max_param_diff

from tests.helpers.margins import within

pytestmark = pytest.mark.slow
SHORT = GPT2 + ["trainer.max_steps=4", "trainer.val_check_interval=4", "test=false"]


def sweep_dir(log_dir: Path) -> Path:
    (sweep,) = (log_dir / "train" / "multiruns").iterdir()
    return sweep


def test_multirun_with_ddp_two_jobs_two_processes(dirs):
    proc = run_script(
        "train.py",
        ["-m", "model.optimizer.lr=1e-3,3e-4", "trainer=ddp", "trainer.devices=2"]
        + QUIET
        + path_overrides(dirs)
        + SHORT,
    )
    out = proc.stdout + proc.stderr
    assert out.count("Launching 2 jobs locally") == 1  # rank 1 no longer re-launches the sweep
    assert not (dirs["log_dir"] / "train" / "runs").exists()  # no stray run dirs from child ranks
    sweep = sweep_dir(dirs["log_dir"])  # exactly one sweep dir
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    for job, lr in (("0", "0.001"), ("1", "0.0003")):
        run = sweep / job
        assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "train_rank1.log").is_file()  # global rank
        assert f"model.optimizer.lr={lr}" in (run / ".hydra" / "overrides.yaml").read_text()
        assert len({event_file_pid(f) for f in event_files(run)}) == 1  # this job's rank 0 only
    losses = [read_events(sweep / j / "tensorboard").Scalars("val/loss")[-1].value for j in ("0", "1")]
    assert losses[0] != losses[1]  # the jobs really ran with their own learning rates


def test_a_failing_job_is_reported_and_the_others_kept(dirs):
    proc = run_script(
        "train.py",
        ["-m", "model.optimizer.lr=-1,3e-4", "trainer=ddp", "trainer.devices=2"] + QUIET + path_overrides(dirs) + SHORT,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1  # the sweep says it had a failure ...
    assert "Error executing job with overrides: ['model.optimizer.lr=-1'" in out
    assert "model.optimizer.lr=-1 is not valid" in out  # the one-line user error (src/utils/errors.py)
    assert (sweep_dir(dirs["log_dir"]) / "1" / "checkpoints" / "last.ckpt").is_file()  # ... and job 1 still ran


def test_optuna_search_three_trials(dirs):
    searched = [a for a in SHORT if not a.startswith("model.scheduler.num_warmup_steps")]  # a fixed value wins
    run_script(
        "train.py",
        ["hparams_search=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.n_startup_trials=2"]
        + QUIET
        + path_overrides(dirs)
        + searched,
    )
    sweep = sweep_dir(dirs["log_dir"])
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert set(results["best_params"]) == {
        "model.optimizer.lr",
        "model.weight_decay",
        "model.scheduler.num_warmup_steps",
    }
    trials = [read_events(sweep / j / "tensorboard").Scalars("val/loss")[-1].value for j in ("0", "1", "2")]
    assert results["best_value"] == pytest.approx(min(trials), abs=1e-6)  # the sweeper read what train.py returned


def test_slurm_launcher_renders_sbatch_from_the_trainer_config():
    import submitit.slurm.slurm
    from omegaconf import OmegaConf
    from test_configs import compose_cfg

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        cfg = compose_cfg(
            [
                "hydra/launcher=slurm",
                "trainer=ddp",
                "trainer.devices=4",
                "trainer.num_nodes=2",
                "hydra.launcher.partition=gpu",
                "hydra.launcher.timeout_min=90",
            ],
            keep_hydra=True,
        )
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert (launcher["nodes"], launcher["tasks_per_node"], launcher["gpus_per_node"]) == (2, 4, 4)
    # the sbatch text submitit writes from them (its executor needs a real `srun`, so we call its renderer;
    # AutoExecutor renames tasks_per_node -> ntasks_per_node and timeout_min -> time)
    text = submitit.slurm.slurm._make_sbatch_string(
        command="python train.py",
        folder="/tmp/submitit-test",
        nodes=launcher["nodes"],
        ntasks_per_node=launcher["tasks_per_node"],
        gpus_per_node=launcher["gpus_per_node"],
        cpus_per_task=launcher["cpus_per_task"],
        time=launcher["timeout_min"],
        partition=launcher["partition"],
        signal_delay_s=launcher["signal_delay_s"],
    )
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --time=90",
        "#SBATCH --partition=gpu",
        "#SBATCH --signal=USR2@120",
    ]:
        assert line in text, (line, text)


def test_submitit_local_launcher_runs_a_job(dirs):
    run_script(
        "train.py",
        ["-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10"] + QUIET + path_overrides(dirs) + SHORT,
    )
    sweep = sweep_dir(dirs["log_dir"])
    assert (sweep / "0" / "checkpoints" / "last.ckpt").is_file()
    assert list((sweep / ".submitit").rglob("*_result.pkl"))  # submitit ran it and stored the result


def test_two_nodes_with_torchrun_train_in_lockstep(tmp_path):
    """2 "nodes" x 1 process on localhost with c10d rendezvous, one shared hydra.run.dir (as on a shared file
    system); num_nodes and devices come from torchrun's env."""
    port, procs, run = free_port(), [], tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHON_EXEC": python()}  # torchrun starts its ranks with it
    for node in (0, 1):
        args = [
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=lockstep",
            f"--node-rank={node}",
            "train.py",
            "trainer=ddp",
            f"hydra.run.dir={run}",
            f"paths.cache_dir={tmp_path / 'cache'}",
            "+callbacks.params._target_=tests.helpers.callbacks.SaveParamsAtEnd",
        ]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", *args] + QUIET + SHORT,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    assert "MEMBER: 2/2" in outs[0] + outs[1]
    rank0, rank1 = torch.load(run / "params_rank0.pt"), torch.load(run / "params_rank1.pt")
    assert max_param_diff(rank0, rank1) == 0.0  # the same parameters on both nodes
    assert (run / "checkpoints" / "last.ckpt").is_file()
    # one log per global rank (both nodes' ranks are local rank 0: they used to share train.log)
    assert "][rank 1][" not in (run / "train.log").read_text()
    assert "][rank 1][" in (run / "train_rank1.log").read_text()
    # only global rank 0 wrote TensorBoard logs
    pid0 = int(re.search(r"\[rank 0\] pid (\d+)", outs[0]).group(1))
    assert {event_file_pid(f) for f in event_files(tmp_path)} == {pid0}


def test_auto_resume_after_sigkill_mid_epoch_ends_like_an_uninterrupted_run(tmp_path):
    """Killed (SIGKILL, no cleanup) at step 8 of a 20-batch epoch, last.ckpt from step 6; the same command
    again continues from it, in the same dir and TensorBoard file set, to the parameters of a run never killed."""
    run = [
        "trainer.max_steps=30",
        "trainer.limit_train_batches=20",
        "trainer.val_check_interval=10",
        "callbacks.last_checkpoint.every_n_train_steps=3",
        "resume=auto",
        "model.scheduler.num_warmup_steps=2",
    ]
    base = QUIET + [f"paths.cache_dir={tmp_path / 'cache'}"] + GPT2 + run
    killed_dir, straight_dir = tmp_path / "killed", tmp_path / "straight"
    first = run_script(
        "train.py",
        base
        + [
            f"hydra.run.dir={killed_dir}",
            "+callbacks.kill._target_=tests.helpers.callbacks.KillAtStep",
            "+callbacks.kill.step=8",
        ],
        check=False,
    )
    assert first.returncode == -9  # SIGKILL
    assert torch.load(killed_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6
    second = run_script("train.py", base + [f"hydra.run.dir={killed_dir}"])
    assert "resume=auto: continuing from" in second.stdout + second.stderr
    run_script("train.py", base + [f"hydra.run.dir={straight_dir}"])
    resumed = torch.load(killed_dir / "checkpoints" / "last.ckpt", weights_only=False)
    straight = torch.load(straight_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert resumed["global_step"] == straight["global_step"] == 30
    within(max_param_diff(resumed["state_dict"], straight["state_dict"]), 1e-6, "params")
    steps = [e.step for e in read_events(killed_dir / "tensorboard").Scalars("train/loss")]
    assert steps[-1] == 29 and len(list((killed_dir / "tensorboard").glob("events*"))) >= 2  # same logger dir


def test_env_knobs_reach_every_rank(dirs):
    run_script(
        "train.py",
        [
            "env=consumer_gpus",
            "trainer=ddp",
            "trainer.devices=2",
            "+callbacks.env._target_=tests.helpers.callbacks.RecordEnv",
        ]
        + QUIET
        + path_overrides(dirs)
        + SHORT,
    )
    (run,) = (dirs["log_dir"] / "train" / "runs").iterdir()
    for rank in (0, 1):
        env = yaml.safe_load((run / f"env_rank{rank}.json").read_text())
        assert env["NCCL_P2P_DISABLE"] == "1" and env["NCCL_IB_DISABLE"] == "1"
