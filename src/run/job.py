"""What every run does around the recipe: fail fast on configs the machine cannot run, seed,
show and save the resolved config, log hyperparameters, and read back the optimized metric."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, ListConfig, OmegaConf

from src.distributed import launcher_env
from src.distributed.checkpointing import RESUME_ENV, candidates, problem, recover
from src.distributed.resharding import check_resume
from src.run.checks import check_machine, check_top_level_keys, check_values
from src.tools.checkpoints import as_pretrained, is_checkpoint, read_config
from src.utils.config import ConfigError, check_targets
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


def prepare(cfg: DictConfig) -> None:
    """Checks before any expensive work, then seed and config tree."""
    import lightning as L

    quiet_console()
    check_top_level_keys(cfg)
    check_targets(cfg)
    check_values(cfg)
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
    save_resolved_config(cfg, Path(cfg.paths.output_dir))
    if cfg.extras.print_config:
        print_config_tree(cfg)


def weights_from_checkpoint(cfg: DictConfig) -> None:
    """model.pretrained may name a checkpoint of this template (file, FSDP2 DCP dir, ZeRO dir): its weights, not its
    optimizer or step, become the start (SFT -> DPO). It is exported once to a Hugging Face dir under
    paths.cache_dir (src.tools.checkpoints.as_pretrained), which model.pretrained then names; data.tokenizer, unless
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

            flat = dict(_flatten(hparams))
            writer = logger.experiment.file_writer  # SummaryWriter's public FileWriter
            for summary in hparams_summary(flat, {m: 0.0 for m in HPARAM_METRICS}):
                writer.add_summary(summary)


def _flatten(d: dict, prefix: str = ""):
    for key, value in d.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict):
            yield from _flatten(value, name)
        else:
            yield name, value if isinstance(value, (bool, int, float, str)) else str(value)


_RESUME_CALLS: list[Path] = []  # resume=auto decisions taken in this process (one per Hydra job)


def _launch_rank() -> int:
    """This process's global rank as far as the environment tells before any process group exists."""
    for key in ("RANK", "SLURM_PROCID"):
        if key in os.environ:
            return int(os.environ[key])
    return int(os.environ.get("NODE_RANK", 0)) + int(os.environ.get("LOCAL_RANK", 0))


def resume_from(cfg: DictConfig) -> Optional[str]:
    """The checkpoint fit starts from (see `resume_point`), refused in one sentence where no loader of the
    configured strategy can read it (src/distributed/resharding.py: any strategy reads any form but DeepSpeed's)."""
    ckpt = resume_point(cfg)
    if ckpt:
        target = str(OmegaConf.select(cfg, "trainer.strategy._target_", default="") or "")
        devices, nodes = cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1)
        devices = len(devices) if isinstance(devices, (list, ListConfig)) else devices
        world = devices * nodes if isinstance(devices, int) and devices > 0 and isinstance(nodes, int) else None
        check_resume(ckpt, deepspeed="deepspeed" in target.lower(), world=world)
    return ckpt


def resume_point(cfg: DictConfig) -> Optional[str]:
    """The checkpoint fit starts from: ckpt_path, or with resume=auto this run dir's newest complete one.

    More than Lightning's `fit(ckpt_path="last")`: "complete" (a save killed half way, a .tmp or a sharded dir
    without its metadata, is skipped or repaired, src/distributed/checkpointing.py), the same for the file and the
    sharded forms, and one decision for all ranks, as below.

    resume=auto is decided once, by rank 0, and every rank uses that decision: no other rank looks at
    the file system, whose view on a shared file system may lag. The ranks Lightning's launcher starts
    inherit the decision through the environment; under torchrun rank 0 posts it in torchrun's
    rendezvous store. Ranks started together otherwise (SLURM's srun, one launcher per node) each
    decide, and `SameResumeOnAllRanks` stops the run with one sentence if they disagree.
    """
    if cfg.resume not in (None, "auto"):
        raise ConfigError(f"resume={cfg.resume!r}: use resume=auto, or ckpt_path=<checkpoint> for a given one.")
    if cfg.resume != "auto":
        return cfg.ckpt_path
    if cfg.ckpt_path:
        raise ConfigError("Set resume=auto or ckpt_path, not both.")
    ckpt_dir = Path(cfg.paths.output_dir).resolve() / "checkpoints"
    rank = _launch_rank()
    inherited = json.loads(os.environ.get(RESUME_ENV, "{}"))
    if rank != 0 and "LOCAL_RANK" in os.environ and inherited.get("dir") == str(ckpt_dir):
        return inherited["ckpt"]  # started by rank 0's launcher: its decision
    store = launcher_env.torchrun_store()
    _RESUME_CALLS.append(ckpt_dir)  # every rank runs the same jobs in order: the count names this job's decision
    key = f"template/resume_auto/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{len(_RESUME_CALLS)}"
    if store is not None and rank != 0:  # torchrun: rank 0 posts its decision in the rendezvous store
        decision = json.loads(store.get(key))
        if "error" in decision:
            raise ConfigError(decision["error"])
        ckpt = decision["ckpt"]
    else:
        try:
            ckpt = decide_resume(ckpt_dir, may_repair=rank == 0)
        except ConfigError as e:
            if store is not None:
                store.set(key, json.dumps({"error": str(e)}))
            raise
        if store is not None:
            store.set(key, json.dumps({"ckpt": ckpt}))
    os.environ[RESUME_ENV] = json.dumps({"dir": str(ckpt_dir), "ckpt": ckpt})
    return ckpt


def decide_resume(ckpt_dir: Path, may_repair: bool = True) -> Optional[str]:
    """last.ckpt if complete, else the newest complete checkpoint in ckpt_dir, else None (fresh start)."""

    last = ckpt_dir / "last.ckpt"
    if may_repair:
        recover(last)  # a kill between a save's two renames: put the previous last.ckpt back
    found = candidates(ckpt_dir)
    if not found:
        log.info(f"resume=auto: no checkpoint in {ckpt_dir} yet, starting fresh")
        return None
    why = problem(last) if last.exists() else "it does not exist"
    if why is None:
        log.info(f"resume=auto: continuing from {last}")
        return str(last)
    for ckpt in found:
        if ckpt != last and not ckpt.name.endswith(".consolidated.ckpt") and problem(ckpt) is None:
            log.warning(
                f"resume=auto: {last} cannot be resumed from ({why}); continuing from {ckpt}, "
                "the newest complete checkpoint in that dir"
            )
            return str(ckpt)
    raise ConfigError(
        f"resume=auto: {last} cannot be resumed from ({why}) and no other checkpoint in {ckpt_dir} is "
        f"complete; delete {ckpt_dir} to start this run afresh, or pass ckpt_path=<a good checkpoint>."
    )


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
