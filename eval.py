"""Evaluate a checkpoint: python eval.py ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt

Rebuilds the model and data exactly as trained (their config is stored in the checkpoint by
train.py), applies any `data.*` / `model.*` overrides given on the command line, then runs
validation and test and prints both, at the precision the checkpoint trained at (unless
`trainer.precision=...` is given), so its val loss is training's last one.
"""

import logging
from pathlib import Path
from typing import Any, Optional

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import src.launch.resolvers  # noqa: F401
from src.checkpoint import safe_load
from src.checkpoint.convert import consolidate, is_sharded, read_config
from src.checkpoint.files import problem
from src.core.plain_loaders import shard_loaders
from src.launch.choices import check_choices
from src.launch.timeouts import distributed_errors
from src.parallel import capabilities
from src.run.always_on import always_on
from src.run.job import check_export_and_seed
from src.utils.config import ConfigError, instantiate_group, register_schemas
from src.utils.errors import user_errors

register_schemas()
log = logging.getLogger(__name__)


def stored_config(cfg: DictConfig) -> Optional[dict[str, Any]]:
    """The config train.py stored in the checkpoint (None: not written by train.py), read without loading (or, for
    shards, gathering) the weights."""
    path = Path(cfg.ckpt_path)
    if problem(path) is not None:  # missing, truncated, not a checkpoint: its checks before the run say which
        return None
    if not (path.is_file() or is_sharded(path)):
        raise ConfigError(
            f"ckpt_path={cfg.ckpt_path!r} is not a checkpoint. Point it at a .ckpt written by "
            "train.py, e.g. logs/train/runs/<run>/checkpoints/last.ckpt"
        )
    return read_config(path)


def given(key: str) -> Optional[str]:
    """This command line's override of `key` (`key=`, `+key=`, `++key=`), else None."""
    for override in HydraConfig.get().overrides.task:
        name, _, value = override.partition("=")
        if name.lstrip("+") == key:
            return value
    return None


def trained_config(cfg: DictConfig, stored: Optional[dict[str, Any]]) -> DictConfig:
    """The checkpoint's model/data config with this command line's model.* / data.* overrides on top."""
    if stored is None:  # not written by train.py: trust the composed config
        return OmegaConf.masked_copy(cfg, ["model", "data"])
    overrides = [o for o in HydraConfig.get().overrides.task if o.split("=")[0].startswith(("data.", "model."))]
    return OmegaConf.merge(OmegaConf.create(stored), OmegaConf.from_dotlist(overrides))


def trained_precision(stored: Optional[dict[str, Any]]) -> tuple[Any, str]:
    """The trainer.precision the checkpoint trained at (train.py stores it), or (None, why it is not known)."""
    if stored is None:
        return None, "the checkpoint holds no config (not written by train.py)"
    precision = (stored.get("trainer") or {}).get("precision")
    if precision is None:
        return None, "the checkpoint holds no trainer.precision (written before train.py stored it)"
    return precision, "the checkpoint"


def choose_precision(cfg: DictConfig, stored: Optional[dict[str, Any]]) -> None:
    """trainer.precision: the command line's if given, else the checkpoint's (so eval reproduces training's val
    loss), else the composed default (the machine's fastest). Says which, and why, in one line."""
    trained, where = trained_precision(stored)
    if given("trainer.precision") is not None:
        also = f"; the checkpoint trained at {trained}" if trained is not None else ""
        log.info(f"Evaluating at trainer.precision={cfg.trainer.precision}: given on the command line{also}")
        return
    gpu = torch.cuda.is_available() and str(cfg.trainer.get("accelerator", "auto")) in ("auto", "gpu", "cuda")
    if trained is not None and str(trained).startswith("16") and not gpu:  # fp16 needs a GPU (src/run/checks.py)
        trained, where = None, f"the checkpoint trained at {trained} ({where}), which needs a GPU and none is used here"
    if trained is None:
        log.warning(
            f"Evaluating at trainer.precision={cfg.trainer.precision}, this machine's default: {where}. Metrics "
            "may differ from training's by the precision; pass trainer.precision=... to choose."
        )
        return
    cfg.trainer.precision = trained
    log.info(
        f"Evaluating at trainer.precision={trained}, the precision the checkpoint trained at (from {where}); "
        "pass trainer.precision=... to choose another"
    )


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
    # the checkpoint is loaded as data and its stored config builds only what conf/ can, unless trust_checkpoint=true
    safe_load.trust(cfg.get("trust_checkpoint", False))
    stored = stored_config(cfg)
    choose_precision(cfg, stored)  # first: check_export_and_seed's machine checks and saved config see what runs
    check_export_and_seed(cfg)
    trained = trained_config(cfg, stored)

    datamodule = instantiate(trained.data)
    shard_loaders(datamodule, cfg.get("seed") or 0)  # a LightningDataModule's own loaders: each rank its share
    # e.g. vocab_size from the tokenizer; a plain LightningDataModule has no model_kwargs
    model = instantiate(trained.model, **getattr(datamodule, "model_kwargs", {}))
    loggers = instantiate_group(cfg.logger, "logger")
    trainer = instantiate(cfg.trainer, logger=loggers, callbacks=always_on("eval", cfg))

    ckpt_path = cfg.ckpt_path
    if is_sharded(ckpt_path) and capabilities.of(trainer.strategy).checkpoint_form == "file":
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
