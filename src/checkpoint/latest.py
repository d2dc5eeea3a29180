"""resume=auto: which checkpoint a run starts from, decided once for all ranks (train.py's `resume_from`)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from src.checkpoint.files import RESUME_ENV, candidates, problem, recover
from src.checkpoint.resharding import check_resume
from src.launch import launcher_env
from src.utils.config import ConfigError, world_size

log = logging.getLogger(__name__)

_RESUME_CALLS: list[Path] = []  # resume=auto decisions taken in this process (one per Hydra job)


def _launch_rank() -> int:
    """This process's global rank as far as the environment tells before any process group exists."""
    for key in ("RANK", "SLURM_PROCID"):
        if key in os.environ:
            return int(os.environ[key])
    return int(os.environ.get("NODE_RANK", 0)) + int(os.environ.get("LOCAL_RANK", 0))


def resume_from(cfg: DictConfig) -> Optional[str]:
    """The checkpoint fit starts from (see `resume_point`), refused in one sentence where no loader of the
    configured strategy can read it (src/checkpoint/resharding.py: any strategy reads any form but DeepSpeed's)."""
    ckpt = resume_point(cfg)
    if ckpt:
        target = OmegaConf.select(cfg, "trainer.strategy._target_", default=None)
        # the strategy's declared form (src/parallel/capabilities.py); Lightning's own DDP and one device write files
        form = getattr(get_object(target), "checkpoint_form", "file") if target else "file"
        check_resume(ckpt, deepspeed=form == "deepspeed", world=world_size(cfg.trainer))
    return ckpt


def resume_point(cfg: DictConfig) -> Optional[str]:
    """The checkpoint fit starts from: ckpt_path, or with resume=auto this run dir's newest complete one.

    More than Lightning's `fit(ckpt_path="last")`: "complete" (a save killed half way, a .tmp or a sharded dir
    without its metadata, is skipped or repaired, src/checkpoint/files.py), the same for the file and the
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
