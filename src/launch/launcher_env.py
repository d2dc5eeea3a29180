"""What the launcher (torchrun, srun, Lightning itself) says about this process, read before Hydra
makes the run dir and before Lightning creates the process group.

Every rank that torchrun or srun starts runs `train.py` and composes its own config, so anything
decided per process -- the `${now:}` in the run dir above all -- must be agreed once, or a job
splits into one dir per rank (measured: torchrun --standalone with 2 processes made two dirs 1-2 s
apart). Ranks that Lightning starts are told the run dir on their command line and need nothing.
"""

from __future__ import annotations

import logging
import os
import signal
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any, Optional

log = logging.getLogger(__name__)
STAMP_KEY = "hydra_ddp/run_stamp"  # in torchrun's agent TCPStore; it outlives elastic restarts
EARLY_SIGNALS: set[int] = set()  # preemption signals that came before the Preemption callback listened


def catch_preemption_signal_early(signum: int = signal.SIGUSR2) -> None:
    """Note SIGUSR2 from train.py's first line on, for the Preemption callback to act on at the first step.

    Its default action ends the process, and SLURM may send it while a run still starts (seconds of imports,
    data preparation, a checkpoint to load): measured on the test cluster under load, a job signalled 29 s
    after its start died with "srun: error: ... tasks 0-1: User defined signal 2" instead of requeueing.
    """
    import threading

    if threading.current_thread() is threading.main_thread():  # signal.signal's rule (train.py imported in a thread)
        signal.signal(signum, lambda received, frame: EARLY_SIGNALS.add(received))


def _agent_store():
    """A client of the TCPStore torchrun's agent hosts at MASTER_ADDR:MASTER_PORT (before any process group)."""
    from torch.distributed import TCPStore

    env = os.environ
    return TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=600))


def torchrun_store():
    """torchrun's agent store when this process runs under it (and before a restart swapped it), else None:
    where rank 0 posts what every rank must agree on before the process group exists."""
    return _agent_store() if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else None


def fresh_store_after_elastic_restart() -> None:
    """After torchrun restarts the group, give the new process group a store of its own.

    torchrun (torch >= 2.4) shares its agent's TCPStore with the workers' process group and keeps it across
    restarts, keys included, so a restarted gloo group read the dead group's addresses and failed
    (measured: "Gloo connectFullMesh failed ... Connection refused", or a hang). Global rank 0 (on the
    store's host) picks a free port for this attempt and the others learn it from the agent store; rank 0
    then hosts the group's store there, as without an agent store.
    """
    env = os.environ
    attempt = _int("TORCHELASTIC_RESTART_COUNT") or 0
    if attempt == 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    import socket

    store, key = _agent_store(), f"hydra_ddp/master_port/{attempt}"
    if _int("RANK") == 0:
        with socket.socket() as s:
            s.bind((env["MASTER_ADDR"], 0))
            port = s.getsockname()[1]
        store.set(key, str(port))
    else:
        port = int(store.get(key))
    log.info(f"torchrun restart {attempt}: the process group gets a fresh store at {env['MASTER_ADDR']}:{port}")
    env["MASTER_PORT"], env["TORCHELASTIC_USE_AGENT_STORE"] = str(port), "False"


def _int(name: str) -> Optional[int]:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def slurm_job_id() -> Optional[str]:
    """The id `scontrol requeue` takes (array tasks: <array job>_<task>); None outside a SLURM batch job."""
    env = os.environ
    if env.get("SLURM_JOB_NAME") in ("bash", "interactive") or "SLURM_JOB_ID" not in env:
        return None  # salloc / srun --pty: an interactive shell, not one job per run
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env["SLURM_JOB_ID"]


def slurm_tasks_per_node() -> Optional[int]:
    """SLURM_NTASKS_PER_NODE, or SLURM_NTASKS / SLURM_NNODES; None outside SLURM."""
    per_node = _int("SLURM_NTASKS_PER_NODE")
    if per_node is None and _int("SLURM_NTASKS") and _int("SLURM_NNODES"):
        per_node = _int("SLURM_NTASKS") // _int("SLURM_NNODES")
    return per_node if slurm_job_id() else None


def slurm_starts_ranks() -> bool:
    """SLURM has one task per rank (srun --ntasks-per-node=G): Lightning's SLURM environment takes the
    ranks as they are. With one task per node, Lightning starts the ranks on each node itself."""
    per_node = slurm_tasks_per_node()
    return per_node is not None and per_node > 1


def count_devices(devices: Any) -> int:
    """trainer.devices as a number of processes per node: 4, [1, 3] -> 2, "auto"/-1 -> 1 if unknown."""
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, str) and devices.strip().isdigit():
        return int(devices)
    if isinstance(devices, (list, tuple)) or hasattr(devices, "__len__") and not isinstance(devices, str):
        return len(devices)
    return 1


def global_rank(devices: Any = 1) -> int:
    """This process's global rank, from what its launcher put in the environment."""
    env = os.environ
    if _int("RANK") is not None:  # torchrun
        return _int("RANK")
    per_node = count_devices(devices)
    if _int("LOCAL_RANK") is not None and _int("NODE_RANK") is not None:  # a rank Lightning started
        return _int("NODE_RANK") * per_node + _int("LOCAL_RANK")
    if slurm_starts_ranks() and _int("SLURM_PROCID") is not None:  # srun, one task per rank
        return _int("SLURM_PROCID")
    if slurm_job_id() and _int("SLURM_NODEID") is not None:  # one task per node: its first rank
        return _int("SLURM_NODEID") * per_node
    return int(env.get("NODE_RANK", "0") or 0) * per_node  # Lightning's rank 0 of node NODE_RANK


def rank_zero_value(value: Any, devices: Any = 1) -> Any:
    """`value` on global rank 0, None elsewhere: e.g. hydra.output_subdir, so only rank 0 writes .hydra/."""
    return value if global_rank(devices) == 0 else None


def log_name(job_name: str, devices: Any = 1) -> str:
    """train.log on global rank 0, train_rank<n>.log on global rank n (unique across nodes)."""
    rank = global_rank(devices)
    return job_name if rank == 0 else f"{job_name}_rank{rank}"


@lru_cache(maxsize=None)  # one answer per process: Hydra may resolve the run dir more than once
def run_stamp(pattern: str = "%Y-%m-%d_%H-%M-%S", parent: Optional[str] = None) -> str:
    """The run dir's name, the same on every rank of a job (and again after a requeue or an elastic restart).

    - SLURM batch job: slurm-<job id>. All tasks share it, and a requeued job keeps its id, so with
      resume=auto the requeued job finds its own last.ckpt.
    - torchrun: rank 0's time, handed to the other ranks through torchrun's TCPStore (the one the
      process group will use; it exists before Lightning creates the group). The key stays in the
      store across elastic restarts, so a restarted group comes back to the same dir.
    - otherwise (one process; Lightning starts the other ranks and passes them the dir): now, and if `parent`
      already holds a dir of that name (another run started in the same second), now_2, now_3, ...: two runs
      never share a dir, its checkpoints and its resume=auto. Without this, two eval.py runs a second apart wrote
      into one dir and the second reused the first's consolidated checkpoint (a flaky test found it).
    """
    job = slurm_job_id()
    if job is not None:
        step = os.environ.get("SLURM_STEP_ID", "0")
        return f"slurm-{job}" if step in ("0", "", "4294967294") else f"slurm-{job}.{step}"  # batch step id
    now = datetime.now().strftime(pattern)
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = _agent_store()
        if _int("RANK") == 0:
            return store.compare_set(STAMP_KEY, "", now).decode()  # an earlier attempt's stamp wins
        return store.get(STAMP_KEY).decode()  # waits for rank 0
    if "TORCHELASTIC_RUN_ID" in env and env["TORCHELASTIC_RUN_ID"] not in ("", "none"):
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}"  # no agent store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
    stamp, n = now, 1
    while parent is not None and os.path.exists(os.path.join(parent, stamp)):
        n += 1
        stamp = f"{now}_{n}"
    return stamp


def device_count(cpu_processes: int = 2) -> int:
    """Processes per node: what a launcher started (torchrun; SLURM with one task per rank), else every
    visible GPU, else `cpu_processes` CPU ranks (gloo).

    SLURM with one task per node (--ntasks-per-node=1 --gpus-per-node=8) is not a rank count: there
    Lightning starts a rank per GPU on each node (src/launch/hydra_ddp.py prepares it).
    Lightning's own `devices=auto` means 1 process on CPU, which would make `trainer=ddp`
    a no-op on a laptop; this keeps the same config meaningful on both kinds of machine.
    """
    if os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():  # torchrun
        return int(os.environ["LOCAL_WORLD_SIZE"])
    if slurm_starts_ranks():  # srun, one task per rank
        return slurm_tasks_per_node()
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else int(cpu_processes)


def num_nodes() -> int:
    """Nodes in the job, from the launcher's environment (torchrun, SLURM), else NUM_NODES, else 1."""
    env = os.environ
    if env.get("WORLD_SIZE", "").isdigit() and env.get("LOCAL_WORLD_SIZE", "").isdigit():  # torchrun
        return int(env["WORLD_SIZE"]) // int(env["LOCAL_WORLD_SIZE"])
    for var in ("SLURM_NNODES", "NUM_NODES"):
        if env.get(var, "").isdigit():
            return int(env[var])
    return 1
