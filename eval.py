"""Evaluate a checkpoint: python eval.py ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt

Rebuilds the model and data exactly as trained (their config is stored in the checkpoint by
train.py), applies any `data.*` / `model.*` overrides given on the command line, then runs
validation and test and prints both.
"""

import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy
from omegaconf import DictConfig, OmegaConf

import src.launch.resolvers  # noqa: F401
from src.callbacks.essentials import CpuThreadsPerRank
from src.checkpoint.convert import consolidate, is_sharded, read_config
from src.launch.choices import check_choices
from src.launch.timeouts import distributed_errors
from src.run.job import prepare
from src.utils.config import ConfigError, instantiate_group, register_schemas
from src.utils.errors import user_errors

register_schemas()
log = logging.getLogger(__name__)


def trained_config(cfg: DictConfig) -> DictConfig:
    """The checkpoint's model/data config with this command line's model.* / data.* overrides on top."""
    path = Path(cfg.ckpt_path)
    if not (path.is_file() or is_sharded(path)):
        raise ConfigError(
            f"ckpt_path={cfg.ckpt_path!r} is not a checkpoint. Point it at a .ckpt written by "
            "train.py, e.g. logs/train/runs/<run>/checkpoints/last.ckpt"
        )
    stored = read_config(path)  # without loading (or, for shards, gathering) the weights
    if stored is None:  # not written by train.py: trust the composed config
        return OmegaConf.masked_copy(cfg, ["model", "data"])
    overrides = [o for o in HydraConfig.get().overrides.task if o.split("=")[0].startswith(("data.", "model."))]
    return OmegaConf.merge(OmegaConf.create(stored), OmegaConf.from_dotlist(overrides))


def consolidated_once(ckpt_path: str, out: Path) -> str:
    """Shards -> one weights file, built by the first rank to get here; the others (all ranks share the
    run dir) wait for it and reuse it instead of each gathering the whole checkpoint again."""
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not out.is_file():
            log.info(f"Consolidating {ckpt_path} into {out} (model weights only)")
            consolidate(ckpt_path, out)  # written under a temporary name, then renamed
    return str(out)


@hydra.main(version_base="1.3", config_path="conf", config_name="eval")
def main(cfg: DictConfig) -> dict[str, float]:
    # a bad key, value, file or checkpoint is one line and exit 2; a failed collective is one line naming
    # rank and collective; SIGTERM exits 143
    with user_errors(cfg), distributed_errors():
        return evaluate(cfg)


def evaluate(cfg: DictConfig) -> dict[str, float]:
    prepare(cfg)
    trained = trained_config(cfg)

    datamodule = instantiate(trained.data)
    model = instantiate(trained.model, **datamodule.model_kwargs)
    loggers = instantiate_group(cfg.logger, "logger")
    trainer = instantiate(cfg.trainer, logger=loggers, callbacks=[CpuThreadsPerRank()])

    ckpt_path = cfg.ckpt_path
    if is_sharded(ckpt_path) and not isinstance(trainer.strategy, (ModelParallelStrategy, DeepSpeedStrategy)):
        ckpt_path = consolidated_once(ckpt_path, Path(cfg.paths.output_dir) / "consolidated.ckpt")
    metrics = {}
    for run in (trainer.validate, trainer.test):
        for results in run(model, datamodule=datamodule, ckpt_path=ckpt_path):
            metrics.update(results)
    if trainer.is_global_zero:
        print("EVAL " + " ".join(f"{k}={v:.6f}" for k, v in sorted(metrics.items())))
    return metrics


if __name__ == "__main__":
    check_choices()  # logger=nosuch: one sentence listing conf/logger/'s options, before Hydra composes
    main()
