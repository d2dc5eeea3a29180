"""Against a real one-node SLURM cluster (munged, slurmctld, slurmd from Debian's packages): docs/clusters.md's sbatch
script (scripts/train.sbatch) exactly as users submit it, submitit's SLURM launcher, preemption by `scancel
--signal=USR2` and by a time limit with real `scontrol requeue`s, and a task that dies. `make test-cluster` starts
the cluster (tests/helpers/slurm_cluster.sh); elsewhere these tests skip.

Each attempt of a job is a fresh `srun python train.py` (no forked stand-in): what a user's job does."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from conftest import ROOT, event_files, read_events
from test_launchers import assert_logs_by_global_rank, last_ckpt, only_dir
from test_parity import GPT2, QUIET, max_param_diff, train

from tests.helpers.margins import within

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.xdist_group("cluster")]

SCRIPT = ROOT / "scripts" / "train.sbatch"
KILL_WAIT_S = 10  # KillWait in tests/helpers/slurm_cluster.sh: SIGKILL this long after SIGTERM
# 2 tasks on the test node's 2 CPUs and 2 stand-in GPUs (the script asks for 4 of each)
TWO_TASKS = ["--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1"]
# 20 steps, 12 batches per epoch (a preemption lands mid-epoch), validation every 10, TensorBoard and CSV
ARGS = (
    QUIET
    + GPT2
    + ["trainer.max_steps=20", "trainer.limit_train_batches=12", "trainer.val_check_interval=10", "logger=many"]
)
SLOW = "+callbacks.slow._target_=tests.helpers.launchers.SlowSteps"  # + callbacks.slow.seconds=...
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    """The environment jobs are submitted with (sbatch exports it to them): the test cluster's SLURM_CONF, this
    venv's `python` first on PATH, nothing from a SLURM job around the tests."""
    conf = os.environ.get("TEST_SLURM_CONF")
    if not conf:
        pytest.skip(os.environ.get("TEST_SLURM_SKIP") or "needs the one-node SLURM cluster of `make test-cluster`")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "TORCHELASTIC_"))}
    return {
        **env,
        "SLURM_CONF": conf,
        "PYTHONUNBUFFERED": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
    }


def slurm(env: dict, *cmd: str) -> str:
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=True, timeout=60).stdout


def sbatch(env: dict, tmp: Path, options: list[str], overrides: list[str]) -> str:
    """The documented script (docs/clusters.md), submitted from the project root, its run dirs under `tmp`: the job id."""
    paths = [f"paths.log_dir={tmp / 'logs'}", f"paths.cache_dir={tmp / 'cache'}"]
    return slurm(
        env, "sbatch", "--parsable", f"--output={tmp}/slurm-%j.out", *options, str(SCRIPT), *overrides, *paths
    ).strip()


@pytest.fixture
def submit(env):
    """sbatch for one test: every job still queued or running when the test ends is cancelled."""
    jobs = []

    def run(tmp: Path, options: list[str], overrides: list[str]) -> str:
        jobs.append(sbatch(env, tmp, options, overrides))
        return jobs[-1]

    yield run
    for job_id in jobs:
        subprocess.run(["scancel", job_id], env=env, capture_output=True)


def job(env: dict, job_id: str) -> dict[str, str]:
    """`scontrol show job`: JobState, Restarts, ExitCode, StartTime, ..."""
    return dict(re.findall(r"(\w+)=(\S*)", slurm(env, "scontrol", "show", "job", "-o", job_id)))


def wait_for(condition, timeout: float, what: str, out: Path | None = None):
    end = time.time() + timeout
    while time.time() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    tail = "\n".join(f.read_text()[-4000:] for f in sorted(out.glob("slurm-*.out"))) if out else ""
    raise AssertionError(f"{what}: not within {timeout:.0f} s\n{tail}")


def finished(env: dict, job_id: str, tmp: Path, timeout: float = 300) -> dict[str, str]:
    return wait_for(lambda: (j := job(env, job_id))["JobState"] in ENDED and j, timeout, f"job {job_id} ended", tmp)


def progress(run: Path) -> list[tuple[int, int, float]]:
    """(attempt, step, time) per training step (tests.helpers.launchers.SlowSteps)."""
    path = run / "progress.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(int(a), int(s), float(t)) for a, s, t in (line.split() for line in lines if line.count(" ") == 2)]


def log_times(log: Path, text: str) -> list[float]:
    """When each line of a rank's log that contains `text` was written."""
    stamp = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")
    return [
        datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for line in log.read_text().splitlines()
        if text in line and (m := stamp.match(line))
    ]


def history(run: Path) -> dict:
    """Every logger's record: TensorBoard scalars by tag, and the rows of csv/metrics.csv."""
    ea = read_events(run / "tensorboard")
    with open(run / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return {"tb": {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}, "csv": rows}


def assert_same_history(a: dict, b: dict, tol: float) -> None:
    assert a["tb"].keys() == b["tb"].keys()
    for tag in a["tb"]:
        assert [s for s, _ in a["tb"][tag]] == [s for s, _ in b["tb"][tag]], tag
        within(max(abs(x - y) for (_, x), (_, y) in zip(a["tb"][tag], b["tb"][tag])), tol, tag)
    assert len(a["csv"]) == len(b["csv"]) and a["csv"][0].keys() == b["csv"][0].keys()
    for row_a, row_b in zip(a["csv"], b["csv"]):
        assert row_a.keys() == row_b.keys() and all((row_a[k] == "") == (row_b[k] == "") for k in row_a), (row_a, row_b)
        for k in (k for k in row_a if row_a[k]):
            within(abs(float(row_a[k]) - float(row_b[k])), tol, f"csv {k}")


@pytest.fixture(scope="module")
def straight(env, tmp_path_factory) -> dict:
    """The documented script with 2 tasks, never interrupted: what every preempted job must end like."""
    tmp = tmp_path_factory.mktemp("straight")
    job_id = sbatch(env, tmp, TWO_TASKS, ARGS)
    try:
        state = finished(env, job_id, tmp)
    finally:
        subprocess.run(["scancel", job_id], env=env, capture_output=True)  # if it has not ended
    return {"job": job_id, "state": state, "tmp": tmp, "run": tmp / "logs" / "train" / "runs" / f"slurm-{job_id}"}


def assert_ends_like(straight: dict, run: Path) -> None:
    """Final parameters within 1e-6 of the uninterrupted job, every logger's history the same."""
    resumed, reference = last_ckpt(run), last_ckpt(straight["run"])
    assert resumed["global_step"] == reference["global_step"] == 20
    within(max_param_diff(resumed["state_dict"], reference["state_dict"]), 1e-6, "params")
    assert_same_history(history(run), history(straight["run"]), 1e-6)


def assert_requeues_ended_by_sigterm(run: Path, requeues: int) -> None:
    """Every requeued attempt ended on SLURM's SIGTERM, each rank with exit status 143 within seconds of the
    requeue (not SIGKILLed KillWait later), and srun saw them exit, not killed."""
    requeued = log_times(run / "train.log", "Requeued SLURM job")
    assert len(requeued) == requeues
    exits = {}
    for rank, log in enumerate([run / "train.log", run / "train_rank1.log"]):
        exits[rank] = log_times(log, f"Rank {rank}: stopped by SIGTERM; exiting with status 143")
        assert len(exits[rank]) == requeues, log.read_text()[-3000:]
        assert all(0 <= end - start < KILL_WAIT_S / 2 for start, end in zip(requeued, exits[rank])), (requeued, exits)
    srun = [
        line.rsplit(": ", 1)[-1]
        for out in run.parents[3].glob("slurm-*.out")
        for line in out.read_text().splitlines()
        if re.match(r"srun: error: .*: tasks? [0-9-]+: ", line)
    ]
    assert srun and set(srun) == {"Exited with exit code 143"}, srun  # not "Killed"


def test_readme_script_two_tasks_equal_one_process(straight, tmp_path):
    """sbatch --ntasks-per-node=2 scripts/train.sbatch: SLURM starts both ranks; one run dir named by the job, one
    .hydra/, TensorBoard from one process, logs by rank, and the parameters of 1 process (<= 1e-5)."""
    assert straight["state"]["JobState"] == "COMPLETED" and straight["state"]["ExitCode"] == "0:0"
    logs, run = straight["tmp"] / "logs", straight["run"]
    assert only_dir(logs / "train" / "runs") == run
    assert [p.parent for p in logs.rglob(".hydra")] == [run]
    files = event_files(logs)
    assert len(files) == 1 and files[0].parent == run / "tensorboard"
    assert_logs_by_global_rank(run, 2)
    log = (run / "train.log").read_text()
    assert f"SLURM job {straight['job']}: one task per rank (2 per node x 1 node(s)): SLURM started 2 ranks" in log
    one = train(tmp_path, "one", ARGS)
    within(max_param_diff(one["params"], last_ckpt(run)["state_dict"]), 1e-5, "params")


def test_scancel_usr2_checkpoints_requeues_and_resumes_twice(env, submit, straight, tmp_path):
    """`scancel --signal=USR2` mid-training, twice: each time the ranks agree on a step, write last.ckpt, rank 0
    runs the real `scontrol requeue`, the old allocation ends on slurmd's SIGTERM within seconds (exit 143, not
    SIGKILL after KillWait), and the job, same id, same run dir, resumes with resume=auto (Restarts=1, then 2).
    It ends with the uninterrupted job's parameters (<= 1e-6) and its whole metric history in TensorBoard and CSV;
    MLflow (logger.mlflow, a SQLite store) holds one run for the job's three attempts, FINISHED, every step once.
    Prints how long each stage of a preemption took, from the signal to the first step of the resumed job."""
    mlflow = pytest.importorskip("mlflow", reason="needs the trackers extra (pip install -e '.[trackers]')")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job_id = submit(
        tmp_path,
        TWO_TASKS,
        ARGS
        + [SLOW, "+callbacks.slow.seconds=0.5", "callbacks.preemption.check_every_n_steps=2"]
        + ["logger=[many,mlflow]", f"logger.mlflow.tracking_uri={store}"],
    )
    run = tmp_path / "logs" / "train" / "runs" / f"slurm-{job_id}"
    signalled, released, running = [], [], []
    for attempt, step in [(0, 3), (1, 11)]:
        wait_for(
            lambda: any(a == attempt and s >= step for a, s, _ in progress(run)),
            120,
            f"attempt {attempt} at step {step}",
            tmp_path,
        )
        slurm(env, "scancel", "--signal=USR2", job_id)
        signalled.append(time.time())
        # the old allocation is gone once the requeued job is pending (or running) again
        wait_for(
            lambda: (j := job(env, job_id))["Restarts"] == str(attempt + 1) and j["JobState"] in ("PENDING", "RUNNING"),
            60,
            f"requeue {attempt + 1}",
            tmp_path,
        )
        released.append(time.time())
        assert released[-1] - signalled[-1] < KILL_WAIT_S
        wait_for(lambda: job(env, job_id)["JobState"] == "RUNNING", 60, f"attempt {attempt + 1} running", tmp_path)
        running.append(time.time())
    state = finished(env, job_id, tmp_path)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0" and state["Restarts"] == "2"
    assert only_dir(tmp_path / "logs" / "train" / "runs") == run
    requeued = log_times(run / "train.log", "Requeued SLURM job")
    assert_requeues_ended_by_sigterm(run, 2)
    assert (run / "train.log").read_text().count("resume=auto: continuing from") == 2
    assert_ends_like(straight, run)
    client = mlflow.MlflowClient(store)
    (tracked,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert tracked.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(tracked.info.run_id, "train/loss")) == list(range(20))
    steps = progress(run)
    for attempt, times in enumerate(zip(signalled, requeued, released, running), 1):
        signal_at, requeue_at, gone_at, running_at = times
        first_at, first_step = min((t, s) for a, s, t in steps if a == attempt)
        print(
            f"preemption {attempt}, seconds after SIGUSR2: requeued {requeue_at - signal_at:.1f}, old allocation "
            f"gone {gone_at - signal_at:.1f}, requeued job running {running_at - signal_at:.1f}, its first step "
            f"(step {first_step}) {first_at - signal_at:.1f}"
        )


def test_time_limit_signal_checkpoints_requeues_and_resumes(env, submit, straight, tmp_path):
    """--time=1 --signal=USR2@1: SLURM sends SIGUSR2 29-59 s after the start (it checks time limits every 30 s);
    the job writes last.ckpt, requeues itself before the limit, ends on SIGTERM, and the requeued attempt
    (Restarts=1) ends like the uninterrupted job. Steps are slow in the first attempt only."""
    job_id = submit(
        tmp_path,
        TWO_TASKS + ["--time=1", "--signal=USR2@1"],
        ARGS
        + [
            SLOW,
            "+callbacks.slow.seconds=3.5",
            "+callbacks.slow.attempts=1",
            "callbacks.preemption.check_every_n_steps=1",
        ],
    )
    wait_for(lambda: job(env, job_id)["Restarts"] == "1", 180, "the requeue before the time limit", tmp_path)
    # a longer limit for the requeued attempt only so that, slow to start on a loaded machine, it is not signalled
    # 29 s into its own minute and requeued once more
    slurm(env, "scontrol", "update", f"JobId={job_id}", "TimeLimit=10")
    state = finished(env, job_id, tmp_path, timeout=240)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0" and state["Restarts"] == "1"
    run = tmp_path / "logs" / "train" / "runs" / f"slurm-{job_id}"
    assert "SIGUSR2 at step" in (run / "train.log").read_text()
    assert_requeues_ended_by_sigterm(run, 1)
    assert_ends_like(straight, run)


def test_a_killed_task_fails_the_job_and_leaves_no_process(env, submit, tmp_path):
    """Rank 1 SIGKILLed at step 3: srun --kill-on-bad-exit=1 ends rank 0 too; the job is FAILED with a non-zero
    exit code within 15 s of the kill (docs/clusters.md: seconds, not trainer.strategy.timeout), and no process of it is
    left on the node."""
    job_id = submit(
        tmp_path,
        TWO_TASKS,
        ARGS
        + [
            SLOW,
            "+callbacks.slow.seconds=0",
            "+callbacks.kill._target_=tests.helpers.launchers.KillRankAtStep",
            "+callbacks.kill.step=3",
        ],
    )
    state = finished(env, job_id, tmp_path, timeout=120)
    run = tmp_path / "logs" / "train" / "runs" / f"slurm-{job_id}"
    killed_at = max(t for _, s, t in progress(run) if s <= 3)
    ended_at = datetime.strptime(state["EndTime"], "%Y-%m-%dT%H:%M:%S").timestamp()
    print(f"a task killed at step 3: the job ended {max(0.0, ended_at - killed_at):.0f} s later (EndTime: 1 s steps)")
    assert state["JobState"] == "FAILED" and state["ExitCode"] != "0:0"
    assert ended_at - killed_at < 15
    assert not [pid for pid in job_processes(job_id)], "processes of the job are still running"


def job_processes(job_id: str) -> list[int]:
    """Processes on this machine whose environment says they belong to SLURM job `job_id`."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in environ:
            pids.append(int(proc.name))
    return pids


def test_submitit_launcher_runs_a_sweep_as_a_job_array(env, tmp_path):
    """python train.py -m hydra/launcher=slurm: submitit's SLURM executor submits the 2 jobs as one array; one
    sweep dir, each job's dir (<sweep>/<n>) with its checkpoint and train.log, submitit's logs and results under
    <sweep>/.submitit/; a 1-task job says it runs one process."""
    cmd = [
        sys.executable,
        "train.py",
        "-m",
        "hydra/launcher=slurm",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.timeout_min=10",
        "model.optimizer.lr=1e-3,3e-4",
        *QUIET,
        *GPT2,
        f"paths.log_dir={tmp_path / 'logs'}",
        f"paths.cache_dir={tmp_path / 'cache'}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert not (tmp_path / "logs" / "train" / "runs").exists()
    sweep = only_dir(tmp_path / "logs" / "train" / "multiruns")
    array = {}
    for n in ("0", "1"):
        assert (sweep / n / "checkpoints" / "last.ckpt").is_file()
        log = (sweep / n / "train.log").read_text()
        found = re.search(r"SLURM job (\d+)_(\d+): one task, one process \(trainer.devices=1\)", log)
        assert found, log[-2000:]
        array[n] = found.groups()
    assert array["0"][0] == array["1"][0] and {array["0"][1], array["1"][1]} == {"0", "1"}  # one array, 2 tasks
    for n, (array_id, task) in array.items():
        assert (sweep / ".submitit" / f"{array_id}_{task}" / f"{array_id}_{task}_0_result.pkl").is_file()
