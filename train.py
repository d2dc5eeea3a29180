"""Train a model: python train.py [trainer=ddp] [model/size=small] [data.path=corpus.txt] [-m sweep ...]

The recipe, top to bottom: check the config, build data -> model -> callbacks/loggers -> trainer
from `conf/`, fit, test the best checkpoint, return the metric a sweeper optimizes.
"""

from typing import Optional

from src.launch.choices import check_choices
from src.launch.launcher_env import catch_preemption_signal_early

catch_preemption_signal_early()  # before the imports below, which take seconds: SLURM's SIGUSR2 would end the job
if __name__ == "__main__":
    check_choices()  # logger=nosuch: one sentence listing conf/logger/'s options, at once, before Hydra composes

import hydra
from hydra.utils import instantiate
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig

import src.launch.resolvers  # noqa: F401  (registers ${project_root:}, ${device_count:} before Hydra composes)
from src.callbacks import trackers
from src.checkpoint import safe_load
from src.checkpoint.latest import resume_from
from src.core.plain_loaders import shard_loaders
from src.launch.hydra_ddp import ddp_job
from src.launch.timeouts import distributed_errors
from src.lm.init import deferred_init
from src.parallel import capabilities
from src.run.always_on import always_on
from src.run.job import check_export_and_seed, log_hyperparameters, metric_value
from src.utils.config import instantiate_group, register_schemas
from src.utils.errors import user_errors

register_schemas()


def train(cfg: DictConfig) -> Optional[float]:
    # checkpoints (ckpt_path, resume=auto, model.pretrained) are loaded as data unless trust_checkpoint=true
    safe_load.trust(cfg.get("trust_checkpoint", False))
    check_export_and_seed(cfg)  # unknown keys, machine checks, model.pretrained exported, seed, config tree

    datamodule = instantiate(cfg.data)
    shard_loaders(datamodule, cfg.seed or 0)  # a LightningDataModule's own loaders: each rank its share
    # conf/callbacks/'s, then the six every training run gets (src/run/always_on.py)
    callbacks = instantiate_group(cfg.callbacks, "callbacks") + always_on("train", cfg)
    ckpt_path = resume_from(cfg) if cfg.train else None  # ckpt_path=, or resume=auto's newest checkpoint
    loggers = trackers.loggers(cfg.logger, ckpt_path)  # a tracker continues the run the checkpoint was logged to
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers)
    # Sharding strategies (FSDP2, ZeRO-3) get the model on the meta device and make each rank's part of it
    with deferred_init(capabilities.of(trainer.strategy).meta_init):
        # what the data tells the model (the template's datamodules: vocab_size from the tokenizer, classes)
        model = instantiate(cfg.model, **getattr(datamodule, "model_kwargs", {}))
    log_hyperparameters(trainer, model, cfg)

    metrics = {}
    if cfg.train:
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
        metrics.update(trainer.callback_metrics)
    if cfg.test and is_overridden("test_step", model):  # (a module without test_step is not tested)
        best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        trainer.test(model, datamodule=datamodule, ckpt_path=best or None)
        metrics.update(trainer.callback_metrics)

    return metric_value(metrics, cfg.optimized_metric)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> Optional[float]:
    # DDP ranks join this job, in this job's dir, also inside a sweep; a failed collective is one line, not a hang;
    # a bad key, value, file or checkpoint is one line and exit 2
    with ddp_job(cfg.trainer.get("devices")), user_errors(cfg), distributed_errors():
        return train(cfg)


if __name__ == "__main__":
    main()
