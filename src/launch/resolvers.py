"""OmegaConf resolvers used by `conf/`: import this module before Hydra composes a config. Most read the
launcher (device and node counts, the run dir agreed by all ranks, which rank writes .hydra/ and its log name)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from src.launch import launcher_env
from src.utils.machine import available_cores, fastest_attention, fastest_precision

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # the dir holding train.py


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
        "device_count": launcher_env.device_count,
        "num_nodes": launcher_env.num_nodes,
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
