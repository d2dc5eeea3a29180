"""Hydra + Lightning's DDP launcher, made safe for sweeps.

Lightning starts each extra rank by re-running the script with `sys.argv` plus
`hydra.run.dir=<HydraConfig.run.dir>`. In a single run that is right; in a multirun `sys.argv`
holds `-m` and the whole sweep, so rank 1 re-launches the sweep (measured here: "Launching 2
jobs locally" printed twice) in another sweep dir, and `hydra.run.dir` is not the job's dir.
We build each child's command from this job's own overrides and output dir instead, in RUN mode
(an Optuna job's overrides hold hparams_search=optuna, whose hydra.mode=MULTIRUN made each child
rank run a sweep of its own: 3 studies, stray sweep dirs, a 60 s wait per trial). Between
jobs, the parent also forgets the previous job's process group and rendezvous variables, or
the next job would believe it had been launched by someone else and wait for ranks forever.

A failed job must not take the sweep down: Lightning's child-process observer SIGKILLs the main
process as soon as a child rank exits non-zero, even after Hydra has moved on to the next job.
So when a job ends we reap its ranks and detach its observer; Hydra reports the failed job with
its overrides and runs the rest.

Before a job starts, ranks that SLURM or torchrun started are prepared here too: a SLURM job with
one task per node lets Lightning start the ranks per node, and a group torchrun restarted gets a
fresh store (src/launch/launcher_env.py says why).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from lightning.pytorch.strategies.launchers import subprocess_script

from src.launch import launcher_env, timeouts

RENDEZVOUS_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "SLURM_NTASKS",
    "TORCHELASTIC_USE_AGENT_STORE",
)
FAILED_JOB_GRACE_S = 5.0  # after a failed job, its ranks get this long to print their own error, then SIGKILL
log = logging.getLogger(__name__)


def reap_child_ranks(timeout: float = 60.0) -> None:
    """Wait up to `timeout` s for the finished job's child ranks, then SIGKILL those still running.

    Lightning's observer thread is detached first: it would SIGKILL this process as soon as a child
    exits non-zero, in the middle of this cleanup. A failed job passes a short timeout: its children
    may be blocked in a collective, where they ignore SIGTERM until the collective timeout.
    """
    for thread in threading.enumerate():
        if thread.name != "child-process-observer":  # lightning.fabric's _ChildProcessObserver
            continue
        children, thread._child_processes = thread._child_processes, []  # its next check ends it, killing no one
        for proc in children:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning(f"Rank process {proc.pid} still running {timeout:.0f}s after its job ended: killing it")
                proc.kill()
                proc.wait()


def job_subprocess_cmd(local_rank: int) -> tuple[Sequence[str], str]:
    """The command that starts rank `local_rank` of *this* Hydra job, in this job's output dir."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd, to_absolute_path

    import __main__

    hc = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    command += [f"--config-name={hc.job.config_name}"]
    command += [f"--config-dir={s['path']}" for s in hc.runtime.config_sources if s["provider"] == "command-line"]
    # config dirs added on the command line (hydra.searchpath=[file://...]): the options this job composed from them
    command += [o for o in hc.overrides.hydra if o.lstrip("+").startswith("hydra.searchpath=")]
    command += list(hc.overrides.task)  # this job's values, e.g. model.optimizer.lr=0.001, not the sweep
    # hydra.mode=RUN: a sweeper's group (hparams_search=optuna) sets MULTIRUN, and is in the job's overrides
    command += [f'hydra.run.dir="{hc.runtime.output_dir}"', "hydra.mode=RUN", "hydra.output_subdir=null"]
    return command, get_original_cwd()


def prepare_slurm(devices: Any = None) -> None:
    """Log how SLURM lays the ranks out; with one task per node, let Lightning start the ranks per node
    (`devices`: trainer.devices, the ranks it starts on each node).

    Lightning's SLURM environment takes every SLURM task as one rank and never starts ranks itself, so
    `--ntasks-per-node=1 --gpus-per-node=8` would train on 1 GPU per node (or fail devices=8 vs
    ntasks-per-node=1). For that layout we hand Lightning the rendezvous as its own launcher reads it
    (MASTER_ADDR = first node, NODE_RANK = this node) and hide SLURM_NTASKS, by which Lightning detects
    SLURM; its ranks then start like on a workstation, on every node.
    """
    from lightning.fabric.plugins.environments import SLURMEnvironment

    env, job = os.environ, launcher_env.slurm_job_id()
    if job is None or "TORCHELASTIC_RUN_ID" in env or "LOCAL_RANK" in env:  # not SLURM, torchrun, or a child rank
        return
    nodes, per_node = launcher_env.num_nodes(), launcher_env.slurm_tasks_per_node() or 1
    if launcher_env.slurm_starts_ranks():
        log.info(
            f"SLURM job {job}: one task per rank ({per_node} per node x {nodes} node(s)): "
            f"SLURM started {per_node * nodes} ranks"
        )
        return
    env["MASTER_ADDR"] = env.get("MASTER_ADDR") or SLURMEnvironment.resolve_root_node_address(
        env.get("SLURM_NODELIST", "127.0.0.1")
    )
    env.setdefault("MASTER_PORT", str(15000 + int(job.replace("_", "")[-4:])))  # Lightning's choice for SLURM
    env["NODE_RANK"] = env.get("SLURM_NODEID", "0")
    env.pop("SLURM_NTASKS", None)
    ranks = launcher_env.count_devices(devices) if devices is not None else launcher_env.device_count()
    if nodes * ranks == 1:
        log.info(f"SLURM job {job}: one task, one process (trainer.devices={devices})")
    else:
        log.info(
            f"SLURM job {job}: one task per node ({nodes} node(s)): Lightning starts {ranks} rank(s) on each node "
            f"(trainer.devices={devices}), rendezvous at {env['MASTER_ADDR']}:{env['MASTER_PORT']}"
        )


@contextmanager
def ddp_job(devices: Any = None) -> Iterator[None]:
    """Run one Hydra job whose DDP ranks are started by Lightning; leave the process clean for the next.
    A job stopped by SIGTERM (exit 143, src/launch/timeouts.py) ends the process as soon as its ranks
    are reaped: Python's own shutdown took 2-6 s more (garbage collection), past a short SLURM KillWait."""
    saved = {k: os.environ.get(k) for k in RENDEZVOUS_VARS}
    prepare_slurm(devices)
    launcher_env.fresh_store_after_elastic_restart()
    original = subprocess_script._hydra_subprocess_cmd
    subprocess_script._hydra_subprocess_cmd = job_subprocess_cmd
    failed = terminated = False
    try:
        yield
    except BaseException as e:
        failed = True  # e.g. a collective timed out here: the other ranks are stuck or already failing
        terminated = isinstance(e, SystemExit) and e.code == timeouts.SIGTERM_EXIT
        raise
    finally:
        subprocess_script._hydra_subprocess_cmd = original
        reap_child_ranks(FAILED_JOB_GRACE_S if failed else 60.0)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if terminated:
            timeouts.exit_now(timeouts.SIGTERM_EXIT)
