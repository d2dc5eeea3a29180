"""SLURM preemption without a cluster (SLURM's variables, a stand-in `scontrol`), so that `make test` keeps what
the real cluster found (tests/test_cluster.py runs the same against slurmctld and slurmd): a requeued job exits
on SIGTERM, a resumed run keeps the CSV logger's history, and a 1-task job says it runs one process."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, free_port, python
from test_launchers import RUN, slurm_env
from test_parity import GPT2, QUIET

CLUSTERS_DOC = ROOT / "docs" / "clusters.md"  # the README links it for SLURM
SCRIPT = ROOT / "scripts" / "train.sbatch"


def test_the_docs_show_the_sbatch_script_that_the_cluster_tests_run():
    assert f"```bash\n{SCRIPT.read_text()}```" in CLUSTERS_DOC.read_text()


def test_a_resumed_run_appends_to_the_csv_logger_history(tmp_path):
    """Lightning's CSVLogger deleted the first attempt's metrics.csv when a run resumed in its dir; this one
    appends, and a metric the first attempt never logged rewrites the file with every earlier row kept. The steps
    the first attempt logged after its checkpoint (2 and 3 here), which the resumed one trains again, are in the
    file once, with the resumed attempt's values (was: twice)."""
    from src.utils.logging import ResumableCSVLogger

    first = ResumableCSVLogger(tmp_path, name="csv", version="")
    first.log_metrics({"train/loss": 2.0}, step=0)
    first.log_metrics({"train/loss": 1.5, "val/loss": 1.7}, step=1)
    first.log_metrics({"train/loss": 1.2}, step=2)
    first.log_metrics({"train/loss": 1.1}, step=3)
    first.finalize("failed")
    second = ResumableCSVLogger(tmp_path, name="csv", version="")
    second.log_metrics({"train/loss": 1.0, "lr": 0.1}, step=2)
    second.log_metrics({"train/loss": 0.9}, step=3)
    second.finalize("success")
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["train/loss"], r["val/loss"], r["lr"]) for r in rows] == [
        ("0", "2.0", "", ""),
        ("1", "1.5", "1.7", ""),
        ("2", "1.0", "", "0.1"),
        ("3", "0.9", "", ""),
    ]


@pytest.mark.slow
def test_a_requeued_job_exits_143_on_sigterm_and_resumes_with_its_whole_csv(tmp_path):
    """A 1-task SLURM job (trainer=default), logger=csv, resume=auto; SIGUSR2 at step 6: last.ckpt, `scontrol
    requeue` (recorded; this stand-in leaves ending the job to the test), then SIGTERM 0.2 s later, as slurmd
    sends it. The job exits 143 within seconds (was: only after callbacks.preemption.wait_s, 60 s here, or
    SLURM's SIGKILL). The same job again continues from step 7 and metrics.csv holds every step once (was:
    only the resumed run's; the learning rate of step 8 twice while the preemption callback came after
    lr_monitor)."""
    from tests.helpers.launchers import stand_in_scontrol

    record = tmp_path / "scontrol_calls.txt"
    stand_in_scontrol(tmp_path / "bin", record, sys.executable, end_job=False)
    args = (
        QUIET
        + GPT2
        + RUN
        + [
            "logger=csv",
            "callbacks.preemption.wait_s=60",  # the failure: waiting all of it for a SIGTERM that came
            f"paths.log_dir={tmp_path / 'logs'}",
            f"paths.cache_dir={tmp_path / 'cache'}",
        ]
    )
    env = slurm_env(
        "77", 0, 1, 1, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", MASTER_PORT=str(free_port())
    )
    signal_at_6 = [
        "+callbacks.sig._target_=tests.helpers.launchers.SignalAtStep",
        "+callbacks.sig.step=6",
        "+callbacks.sig.rank=0",
    ]
    proc = subprocess.Popen(
        [python(), "train.py", *args, *signal_at_6],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    end = time.time() + 300
    while not (record.exists() and record.read_text() == "requeue 77\n") and proc.poll() is None and time.time() < end:
        time.sleep(0.05)
    time.sleep(0.2)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    waited = time.time() - sent
    print(f"SIGTERM 0.2 s after the requeue: exit {proc.returncode} {waited:.1f} s later")
    assert proc.returncode == 143 and waited < 20, out[-3000:]  # < 1 s unloaded; far from wait_s
    assert "SLURM job 77: one task, one process (trainer.devices=1)" in out  # was "Lightning starts ... ranks"
    run = tmp_path / "logs" / "train" / "runs" / "slurm-77"
    second = subprocess.run(
        [python(), "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert second.returncode == 0 and "resume=auto: continuing from" in second.stdout + second.stderr
    with open(run / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for metric in ("train/loss", "lr-AdamW/decay"):  # logged at each step's end / start: none lost, none twice
        assert [int(r["step"]) for r in rows if r[metric]] == list(range(20)), metric


@pytest.mark.slow
def test_sigusr2_during_start_up_is_acted_on_at_the_first_step(tmp_path):
    """SIGUSR2 1 s after `python train.py` starts, while it still imports torch (a fresh interpreter, not the
    tests' forked stand-in): the run lives on, writes last.ckpt at step 1 and requeues (was: killed by the signal's
    default action, "User defined signal 2", as the real cluster showed under load)."""
    from tests.helpers.launchers import stand_in_scontrol

    record = tmp_path / "scontrol_calls.txt"
    stand_in_scontrol(tmp_path / "bin", record, sys.executable)  # ends the job at the requeue, like SLURM
    env = slurm_env(
        "78", 0, 1, 1, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", MASTER_PORT=str(free_port())
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            *QUIET,
            *GPT2,
            *RUN,
            f"paths.log_dir={tmp_path / 'logs'}",
            f"paths.cache_dir={tmp_path / 'cache'}",
        ],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        process_group=0,
    )
    time.sleep(1.0)
    proc.send_signal(signal.SIGUSR2)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == -signal.SIGKILL, out[-3000:]  # the stand-in scontrol's end of the job
    assert record.read_text() == "requeue 78\n" and "SIGUSR2 at step 1" in out
