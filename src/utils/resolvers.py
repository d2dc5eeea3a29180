"""OmegaConf resolvers used by `conf/`. Import this module before Hydra composes a config."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf

from src.distributed import launcher_env
from src.utils.machine import available_cores

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def device_count(cpu_processes: int = 2) -> int:
    """Processes per node: what a launcher started (torchrun; SLURM with one task per rank), else every
    visible GPU, else `cpu_processes` CPU ranks (gloo).

    SLURM with one task per node (--ntasks-per-node=1 --gpus-per-node=8) is not a rank count: there
    Lightning starts a rank per GPU on each node (src/distributed/hydra_ddp.py prepares it).
    Lightning's own `devices=auto` means 1 process on CPU, which would make `trainer=ddp`
    a no-op on a laptop; this keeps the same config meaningful on both kinds of machine.
    """
    if os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():  # torchrun
        return int(os.environ["LOCAL_WORLD_SIZE"])
    if launcher_env.slurm_starts_ranks():  # srun, one task per rank
        return launcher_env.slurm_tasks_per_node()
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


def fastest_precision(accelerator: str = "auto") -> str:
    """The fastest correct precision for the hardware found: trainer.precision's default.

    GPU: bf16-mixed where bf16 is native (Ampere and newer), else 16-mixed (fp16 with a gradient scaler).
    CPU: bf16-mixed with AVX512-BF16 or AMX instructions (measured 1.3-2.4x faster than fp32 on such a
    CPU, docs/performance.md), else 32-true, as bf16 has no fast matmul path without them.
    """
    import torch

    if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    if accelerator not in ("auto", "cpu"):
        return "32-true"  # e.g. mps: leave it to the user
    # torch.cpu's capability probes are private, hence the getattr: absent in some torch, then fp32
    probes = (getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return "bf16-mixed" if any(probe is not None and probe() for probe in probes) else "32-true"


def fastest_attention(accelerator: str, precision: str, seq_len: int) -> str:
    """GPT-2's attention kernel (model.attn_implementation): torch's fused SDPA, except where plain
    matmuls measured faster: bf16 on a CPU at contexts up to 256, 1.25-1.55x here; at 512 eager
    gained only 1.08-1.14x for 35% more memory, at 1024 SDPA won 2x, and in fp32 they are within
    6% up to 512 (docs/performance.md). GPUs: SDPA, which dispatches to flash attention there
    (not measured here).
    """
    import torch

    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    return "eager" if on_cpu and precision == "bf16-mixed" and int(seq_len) <= 256 else "sdpa"


def run_dir() -> str:
    """This run's dir (paths.output_dir): Hydra's runtime.output_dir, or where Hydra has made none
    (`python train.py --cfg job --resolve` prints the config without running), the dir a run would use."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    hydra_cfg = HydraConfig.get()
    output_dir = OmegaConf.select(hydra_cfg, "runtime.output_dir", throw_on_missing=False)
    return output_dir or hydra_cfg.run.dir


def register() -> None:
    resolvers = {
        "project_root": lambda: str(PROJECT_ROOT),
        "device_count": device_count,
        "num_nodes": num_nodes,
        "run_stamp": launcher_env.run_stamp,  # run dir name agreed by all ranks (conf/hydra/default.yaml)
        "rank_zero_value": launcher_env.rank_zero_value,
        "log_name": launcher_env.log_name,
        "cpu_count": available_cores,
        "fastest_precision": fastest_precision,
        "fastest_attention": fastest_attention,
        "run_dir": run_dir,
        "coalesce": lambda *values: next((v for v in values if v is not None), None),  # first non-null
    }
    for name, fn in resolvers.items():
        if not OmegaConf.has_resolver(name):
            # run_stamp is cached in the config, as Hydra's ${now:} is: a job that submitit unpickles later
            # in another process must see the sweep dir its launcher made, not a new time
            OmegaConf.register_new_resolver(name, fn, use_cache=name == "run_stamp")


register()
