"""What every run does around the recipe: fail fast on configs the machine cannot run, seed,
show and save the resolved config, log hyperparameters, and read back the optimized metric."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from src.checkpoint.convert import as_pretrained, is_checkpoint, read_config
from src.core import plain_loaders as plain
from src.run.checks import check_machine, check_top_level_keys, resolve_and_check_values
from src.utils.config import ConfigError, check_targets, flatten
from src.utils.logging import quiet_console

log = logging.getLogger(__name__)


# Config values that name files or dirs (model.pretrained also decides data.tokenizer's default).
PATH_KEYS = (
    "model.pretrained",
    "data.path",
    "data.input_dir",
    "data.tokenizer",
    "trainer.strategy.config",
    "ckpt_path",
)


def absolute_paths(cfg: DictConfig) -> None:
    """Paths typed relative to the launch dir, made absolute in `cfg` before anything reads them.

    The checkpoint stores the config, and eval.py or `src.tools.checkpoints export-hf` started from
    another dir must find the same files. Only values that exist on disk change, so hub names
    (`gpt2`) and interpolations (they follow their source) stay as written.
    """
    nodes = [(key.rpartition(".")[0], key.rpartition(".")[2]) for key in PATH_KEYS]
    nodes += [(f"data.mix[{i}]", "path") for i in range(len(OmegaConf.select(cfg, "data.mix") or []))]
    for parent_key, leaf in nodes:
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        if not isinstance(parent, DictConfig) or leaf not in parent or OmegaConf.is_interpolation(parent, leaf):
            continue
        value = parent[leaf]
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute() and Path(value).exists():
            parent[leaf] = str(Path(value).resolve())


def check_export_and_seed(cfg: DictConfig) -> None:
    """Checks before any expensive work, changing `cfg` where they resolve a value (model.compile=auto, paths made
    absolute); a model.pretrained checkpoint of this template exported to a Hugging Face dir, which `cfg` then names;
    then the seed, the matmul precision, config_resolved.yaml and the config tree."""
    import lightning as L

    quiet_console()
    check_top_level_keys(cfg)
    plain.check_config(cfg)  # a plain LightningDataModule's overfit and batch: before the key check's general word
    check_targets(cfg)
    resolve_and_check_values(cfg)
    check_machine(cfg.trainer)
    absolute_paths(cfg)
    weights_from_checkpoint(cfg)
    if cfg.trainer.get("use_distributed_sampler", True):
        raise ConfigError(
            "trainer.use_distributed_sampler must be false: the datamodules shard the data themselves "
            "(Lightning's sampler would pad val/test with repeated samples and shard twice)."
        )
    if cfg.trainer.get("overfit_batches", 0):
        raise ConfigError(
            f"trainer.overfit_batches={cfg.trainer.overfit_batches} is not supported (Lightning's makes every "
            "rank read the same batches); use data.overfit_batches=N or debug=overfit instead."
        )
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    set_matmul_precision(cfg.get("float32_matmul_precision", "highest"))
    save_resolved_config(cfg, Path(cfg.paths.output_dir))
    if cfg.extras.print_config:
        print_config_tree(cfg)


def set_matmul_precision(precision: str) -> None:
    """float32_matmul_precision: torch's precision for fp32 matrix products (TF32 on GPUs that have it, for `high`),
    set the same on every rank, before any model is built."""
    import torch

    if precision not in ("highest", "high", "medium"):
        raise ConfigError(f"float32_matmul_precision={precision!r}: use highest, high or medium.")
    torch.set_float32_matmul_precision(precision)


def weights_from_checkpoint(cfg: DictConfig) -> None:
    """model.pretrained may name a checkpoint of this template (file, FSDP2 DCP dir, ZeRO dir): its weights, not its
    optimizer or step, become the start (SFT -> DPO). It is exported once to a Hugging Face dir under
    paths.cache_dir (src.checkpoint.convert.as_pretrained), which model.pretrained then names; data.tokenizer, unless
    set, becomes the checkpoint's own."""

    pretrained = OmegaConf.select(cfg, "model.pretrained", default=None)
    if not isinstance(pretrained, str) or not Path(pretrained).exists() or not is_checkpoint(pretrained):
        return
    stored = read_config(pretrained) or {}
    tokenizer = stored.get("data", {}).get("tokenizer")
    if tokenizer is not None and "tokenizer" in cfg.data and OmegaConf.is_interpolation(cfg.data, "tokenizer"):
        cfg.data.tokenizer = tokenizer
    cfg.model.pretrained = str(as_pretrained(pretrained, cfg.paths.cache_dir))
    log.info(f"model.pretrained: the weights of {pretrained}, exported to {cfg.model.pretrained}")


@rank_zero_only
def save_resolved_config(cfg: DictConfig, run_dir: Path) -> None:
    """Hydra saves the config with ${...} unresolved in .hydra/; this is what the run really used."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config_resolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))


@rank_zero_only
def print_config_tree(cfg: DictConfig) -> None:
    """The resolved config as a rich tree, one branch per group."""
    import rich
    import rich.syntax
    import rich.tree

    groups = [k for k in ["data", "model", "callbacks", "logger", "trainer", "paths"] if k in cfg]
    groups = [k for k in groups + list(cfg) if isinstance(cfg[k], DictConfig)]
    groups = list(dict.fromkeys(groups))  # dedupe, keep order
    scalars = OmegaConf.masked_copy(cfg, [k for k in cfg if k not in groups])
    tree = rich.tree.Tree("CONFIG", guide_style="dim")
    for key, node in [(k, cfg[k]) for k in groups] + [("run", scalars)]:
        tree.add(f"[bold]{key}").add(rich.syntax.Syntax(OmegaConf.to_yaml(node, resolve=True), "yaml"))
    rich.print(tree)


HPARAM_METRICS = ("val/loss", "val/ppl", "test/loss", "test/ppl")  # columns of TensorBoard's HPARAMS tab


@rank_zero_only
def log_hyperparameters(trainer: Any, model: Any, cfg: DictConfig) -> None:
    """The whole resolved config plus parameter counts, so TensorBoard's HPARAMS tab compares runs."""
    hparams = OmegaConf.to_container(cfg, resolve=True)
    hparams["model"]["params_total"] = sum(p.numel() for p in model.parameters())
    hparams["model"]["params_trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    for logger in trainer.loggers:
        logger.log_hyperparams(hparams)  # hparams.yaml / CSV
        if isinstance(logger, TensorBoardLogger):
            # Lightning writes the HPARAMS summary only together with metric *values* it logs at step 0;
            # declaring the metric tags instead lets TensorBoard show the real val/test values per run.
            from torch.utils.tensorboard.summary import hparams as hparams_summary

            flat = dict(flatten(hparams))
            writer = logger.experiment.file_writer  # SummaryWriter's public FileWriter
            for summary in hparams_summary(flat, {m: 0.0 for m in HPARAM_METRICS}):
                writer.add_summary(summary)


def optimizing_sweeper() -> bool:
    """Whether this job runs under a sweeper that reads train.py's return value (Optuna, ...), not a grid."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return False
    target = str(HydraConfig.get().sweeper.get("_target_", ""))
    return not target.endswith("BasicSweeper")


def metric_value(metrics: dict[str, Any], name: Optional[str]) -> Optional[float]:
    """optimized_metric's value for the sweeper. Missing, it fails the job only where an optimizing sweeper
    needs it; a finished run (e.g. one that never validated) is not turned into a failure for it."""
    if not name:
        return None
    if name not in metrics:
        msg = (
            f"optimized_metric={name!r} was not logged. Logged metrics: {sorted(metrics)}. "
            "Set optimized_metric to one of them."
        )
        if optimizing_sweeper():
            raise ConfigError(msg)
        log.warning(msg)
        return None
    value = float(metrics[name])
    log.info(f"{name} = {value:.6f}")
    return value
