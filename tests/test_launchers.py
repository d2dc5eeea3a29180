"""Launchers behave like one run: torchrun and srun ranks share one run dir and name their logs by global
rank, SLURM preemption and torchrun elastic restarts continue to the parameters of an uninterrupted
run, Optuna trials with DDP stay in their sweep, and short runs validate at the end."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FULL_MATRIX_ONLY, ROOT, free_port, path_overrides, python, read_events, run_script
from test_parity import GPT2, QUIET, max_param_diff

from tests.helpers.margins import within

# Under pytest-xdist these tests run on one worker: they share module fixtures (runs) that it makes once.
pytestmark = pytest.mark.xdist_group("launchers")

# 20 steps, 12 batches per epoch: an interruption at step 8 is mid-epoch
RUN = [
    "trainer.max_steps=20",
    "trainer.limit_train_batches=12",
    "trainer.val_check_interval=10",
    "resume=auto",
    "model.scheduler.num_warmup_steps=2",
]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    return {**env, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1", **extra}


def slurm_env(job: str, procid: int, ntasks: int, per_node: int, **extra: str) -> dict[str, str]:
    """What srun puts in each task's environment (one node)."""
    return clean_env(
        SLURM_JOB_ID=job,
        SLURM_JOB_NAME="train",
        SLURM_NTASKS=str(ntasks),
        SLURM_NTASKS_PER_NODE=str(per_node),
        SLURM_NNODES="1",
        SLURM_NODEID="0",
        SLURM_PROCID=str(procid),
        SLURM_LOCALID=str(procid),
        SLURM_NODELIST="127.0.0.1",
        **extra,
    )


def only_dir(parent: Path) -> Path:
    (child,) = [p for p in parent.iterdir() if p.is_dir()]
    return child


def last_ckpt(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


def assert_logs_by_global_rank(run: Path, ranks: int) -> None:
    assert "][rank 1][" not in (run / "train.log").read_text()  # rank 0's file holds rank 0's lines only
    for rank in range(1, ranks):
        assert f"][rank {rank}][" in (run / f"train_rank{rank}.log").read_text()


# ---- fast: which rank a launcher's process is, from its environment ----


@pytest.mark.parametrize(
    "env, devices, rank",
    [
        ({"RANK": "3", "LOCAL_RANK": "1"}, 2, 3),  # torchrun
        ({"NODE_RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}, 2, 3),  # a rank Lightning started on node 1
        ({"NODE_RANK": "1"}, 4, 4),  # Lightning's rank 0 on node 1
        (
            {
                "SLURM_JOB_ID": "9",
                "SLURM_NTASKS": "8",
                "SLURM_NTASKS_PER_NODE": "4",
                "SLURM_PROCID": "5",
                "SLURM_NODEID": "1",
            },
            4,
            5,
        ),  # srun, one task per rank
        (
            {
                "SLURM_JOB_ID": "9",
                "SLURM_NTASKS": "2",
                "SLURM_NTASKS_PER_NODE": "1",
                "SLURM_PROCID": "1",
                "SLURM_NODEID": "1",
            },
            8,
            8,
        ),  # srun, one task per node
    ],
)
def test_global_rank_names_logs_and_hydra_dir(monkeypatch, env, devices, rank):
    from src.launch import launcher_env

    for key in list(os.environ):
        if key.startswith(("SLURM_", "TORCHELASTIC_")) or key in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launcher_env.global_rank(devices) == rank
    assert launcher_env.log_name("train", devices) == f"train_rank{rank}"
    assert launcher_env.rank_zero_value(".hydra", devices) is None


def test_device_count_follows_the_slurm_layout(monkeypatch):
    from src.launch.launcher_env import device_count

    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS", "SLURM_NNODES", "SLURM_JOB_NAME"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "1")  # --ntasks-per-node=1 --gpus-per-node=8
    assert device_count() == 8  # Lightning starts 8 ranks per node (was 1: one GPU per node, silently)
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")  # one task per rank
    assert device_count() == 4


def test_two_runs_started_in_the_same_second_get_two_dirs(monkeypatch, tmp_path):
    """A plain launch names its run dir by the second; one that finds that dir taken (another run started in the
    same second) takes now_2, ... Two eval.py runs a second apart once shared a dir (and a consolidated checkpoint)."""
    from datetime import datetime, timedelta

    from src.launch.launcher_env import run_stamp

    for var in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    start = datetime.now()
    taken = {(start + timedelta(seconds=s)).strftime("%Y-%m-%d_%H-%M-%S") for s in range(3)}
    for name in taken:
        (tmp_path / name).mkdir()
    stamp = run_stamp.__wrapped__("%Y-%m-%d_%H-%M-%S", str(tmp_path))  # as a new process would: no cache
    assert stamp.endswith("_2") and stamp[:-2] in taken and not (tmp_path / stamp).exists()
    assert run_stamp.__wrapped__("%Y-%m-%d_%H-%M-%S", str(tmp_path / "empty")) in taken  # a free name is kept


def test_env_cluster_leaves_socket_interface_to_nccl_and_gloo(monkeypatch):
    from test_configs import compose_cfg

    for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(key, raising=False)
    env_set = compose_cfg(["env=cluster"], keep_hydra=True).hydra.job.env_set
    assert "NCCL_SOCKET_IFNAME" not in env_set and "GLOO_SOCKET_IFNAME" not in env_set  # was forced to eth0


# ---- slow: real train.py processes ----


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    """The uninterrupted run the interrupted ones must end like: 2 processes started by Lightning."""
    tmp = tmp_path_factory.mktemp("straight")
    run_script(
        "train.py",
        QUIET
        + GPT2
        + RUN
        + ["trainer=ddp", "trainer.devices=2", f"hydra.run.dir={tmp / 'run'}", f"paths.cache_dir={tmp / 'cache'}"],
    )
    return last_ckpt(tmp / "run")


@pytest.mark.slow
@FULL_MATRIX_ONLY  # suite time, 17 s: the elastic-restart test below checks one run dir under torchrun too
def test_torchrun_ranks_share_one_run_dir(dirs):
    """torchrun --standalone, no hydra.run.dir: one timestamped dir (was two, 1-2 s apart), logs by rank."""
    cmd = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "train.py", "trainer=ddp"]
        + QUIET
        + GPT2
        + ["trainer.max_steps=4", "trainer.val_check_interval=4"]
        + path_overrides(dirs)
    )
    proc = subprocess.run(
        cmd, cwd=ROOT, env=clean_env(PYTHON_EXEC=python()), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = only_dir(dirs["log_dir"] / "train" / "runs")
    assert (run / ".hydra" / "overrides.yaml").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    assert_logs_by_global_rank(run, 2)


@pytest.mark.slow
def test_slurm_preemption_requeues_and_the_requeued_job_continues(tmp_path, straight):
    """Two srun tasks (SLURM's variables, a stand-in scontrol on PATH). SIGUSR2 reaches rank 1 only, at step 7;
    the ranks agree at step 8, write last.ckpt, requeue (the stand-in kills the job as SLURM would). The same
    command with the same job id then continues in the same dir to an uninterrupted run's parameters."""
    from tests.helpers.launchers import stand_in_scontrol

    record, job = tmp_path / "scontrol_calls.txt", tmp_path / "job_pgid"
    stand_in_scontrol(tmp_path / "bin", record, sys.executable, job_pgid_file=job)
    args = (
        QUIET
        + GPT2
        + RUN
        + ["trainer=ddp", "callbacks.preemption.check_every_n_steps=2"]
        + path_overrides({"log_dir": tmp_path / "logs", "cache_dir": tmp_path / "cache"})
    )
    path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"

    def srun(extra: list[str]) -> list[subprocess.CompletedProcess]:
        port, procs = str(free_port()), []
        for rank in (0, 1):
            env = slurm_env("4242", rank, 2, 2, PATH=path, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            group = {"process_group": 0 if rank == 0 else procs[0].pid}  # one job, one group
            procs.append(
                subprocess.Popen(
                    [python(), "train.py", *args, *extra],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    **group,
                )
            )
            job.write_text(str(procs[0].pid))  # the group scontrol requeue kills
        return [(p, p.communicate(timeout=600)[0]) for p in procs]

    first = srun(["+callbacks.sig._target_=tests.helpers.launchers.SignalAtStep", "+callbacks.sig.step=7"])
    assert [p.returncode for p, _ in first] == [-9, -9], first[0][1][-3000:] + first[1][1][-3000:]
    assert record.read_text() == "requeue 4242\n"
    run = only_dir(tmp_path / "logs" / "train" / "runs")
    assert run.name == "slurm-4242"  # both tasks, one dir, named by the job (kept across the requeue)
    assert last_ckpt(run)["global_step"] == 8
    second = srun([])
    assert all(p.returncode == 0 for p, _ in second), second[0][1][-3000:]
    assert "resume=auto: continuing from" in second[0][1]
    assert only_dir(tmp_path / "logs" / "train" / "runs") == run
    resumed = last_ckpt(run)
    assert resumed["global_step"] == straight["global_step"] == 20
    within(max_param_diff(resumed["state_dict"], straight["state_dict"]), 1e-6, "params")
    assert_logs_by_global_rank(run, 2)


@FULL_MATRIX_ONLY  # suite time, 36 s: resuming from the last checkpoint under torchrun stays (test_resume_anywhere.py's elastic node loss, test_scaleout.py's SIGKILL resume)
@pytest.mark.slow
def test_torchrun_elastic_restart_continues_from_last_checkpoint(dirs, straight):
    """Rank 1 of 2 SIGKILLed at step 8 (last.ckpt from step 5); torchrun --max-restarts=1 restarts both ranks,
    which come back to the same agreed run dir and end with an uninterrupted run's parameters; csv/metrics.csv
    holds every step once (was: the steps after the checkpoint twice, 23 rows for 20 steps), and so do the MLflow
    run (an `mlflow server`) and the W&B run (offline), each one run continued by the restart, with the CSV's
    values (tests/test_trackers.py for the rest of the trackers)."""
    mlflow = pytest.importorskip("mlflow", reason="needs the trackers extra (pip install -e '.[trackers]')")
    from tests.helpers.trackers import mlflow_server, wandb_history, wandb_runs

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "train.py",
        "trainer=ddp",
        "callbacks.last_checkpoint.every_n_train_steps=5",
        "+callbacks.kill._target_=tests.helpers.launchers.KillRankAtStep",
        "+callbacks.kill.step=8",
        "logger=[csv,mlflow,wandb]",
    ]
    with mlflow_server(dirs["log_dir"].parent) as uri:
        proc = subprocess.run(
            cmd + QUIET + GPT2 + RUN + path_overrides(dirs) + [f"logger.mlflow.tracking_uri={uri}"],
            cwd=ROOT,
            env=clean_env(PYTHON_EXEC=python(), WANDB_MODE="offline", WANDB_API_KEY=""),
            capture_output=True,
            text=True,
            timeout=600,
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        client = mlflow.MlflowClient(uri)
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert len(runs) == 1 and runs[0].info.status == "FINISHED", [r.info for r in runs]
        points = client.get_metric_history(runs[0].info.run_id, "train/loss")
        assert sorted(m.step for m in points) == list(range(20))  # every step once
        mlflow_loss = {m.step: m.value for m in points}
    assert "resume=auto: continuing from" in out
    run = only_dir(dirs["log_dir"] / "train" / "runs")  # the restarted group found the first attempt's dir
    resumed = last_ckpt(run)
    assert resumed["global_step"] == straight["global_step"] == 20
    within(max_param_diff(resumed["state_dict"], straight["state_dict"]), 1e-6, "params")
    with open(run / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows if r["train/loss"]] == list(range(20))
    assert {int(r["step"]): float(r["train/loss"]) for r in rows if r["train/loss"]} == mlflow_loss
    attempts = wandb_runs(run / "wandb")
    assert len(attempts) == 2 and attempts[0]["id"] == attempts[1]["id"] and attempts[1]["exit_code"] == 0
    logged = [(r["trainer/global_step"], r["train/loss"]) for r in wandb_history(run / "wandb") if "train/loss" in r]
    assert dict(logged) == mlflow_loss and [s for s, _ in logged] == list(range(20))


@pytest.mark.slow
@FULL_MATRIX_ONLY  # suite time, 19 s: test_scaleout's multirun of DDP jobs (child ranks joining their job) stays
def test_optuna_with_ddp_one_study_one_sweep_dir(dirs):
    """2 trials x 2 processes: the child ranks join their trial (they used to run sweeps of their own)."""
    short = [a for a in GPT2 if not a.startswith("model.scheduler.num_warmup_steps")]
    proc = run_script(
        "train.py",
        [
            "hparams_search=optuna",
            "trainer=ddp",
            "trainer.devices=2",
            "hydra.sweeper.n_trials=2",
            "hydra.sweeper.sampler.n_startup_trials=2",
            "trainer.max_steps=4",
            "trainer.val_check_interval=4",
        ]
        + QUIET
        + path_overrides(dirs)
        + short,
    )
    out = proc.stdout + proc.stderr
    assert out.count("Study name:") == 1 and "still running" not in out  # no stuck child rank to reap
    assert not (dirs["log_dir"] / "train" / "runs").exists()
    sweep = only_dir(dirs["log_dir"] / "train" / "multiruns")
    assert (sweep / "optimization_results.yaml").is_file()
    for trial in ("0", "1"):
        assert (sweep / trial / "checkpoints" / "last.ckpt").is_file()
        assert_logs_by_global_rank(sweep / trial, 2)


@pytest.mark.slow
def test_slurm_one_task_per_node_lightning_starts_the_ranks_and_a_short_run_validates(tmp_path):
    """sbatch --ntasks-per-node=1, `python train.py trainer=ddp`: Lightning starts 2 ranks (was 1, silently);
    max_steps=6 < val_check_interval=100 validates once at the end and exits 0 (was: exit 1, no val/loss)."""
    proc = subprocess.run(
        [
            python(),
            "train.py",
            "trainer=ddp",
            "trainer.val_check_interval=100",
            f"paths.log_dir={tmp_path / 'logs'}",
            f"paths.cache_dir={tmp_path / 'cache'}",
        ]
        + QUIET
        + GPT2,
        cwd=ROOT,
        env=slurm_env("77", 0, 1, 1, MASTER_PORT=str(free_port())),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "SLURM job 77: one task per node" in out
    run = tmp_path / "logs" / "train" / "runs" / "slurm-77"
    assert_logs_by_global_rank(run, 2)
    assert len(read_events(run / "tensorboard").Scalars("val/loss")) == 1  # once, at the last step


def test_a_run_shorter_than_val_check_interval_validates_at_the_end_and_succeeds(dirs):
    """max_steps=6 < val_check_interval=100: one validation at step 6, val/loss returned, exit 0 (was exit 1:
    optimized_metric='val/loss' was not logged)."""
    proc = run_script("train.py", QUIET + GPT2 + ["trainer.val_check_interval=100"] + path_overrides(dirs))
    assert "val/loss = " in proc.stdout + proc.stderr
    run = only_dir(dirs["log_dir"] / "train" / "runs")
    assert len(read_events(run / "tensorboard").Scalars("val/loss")) == 1
    assert last_ckpt(run)["global_step"] == 6
