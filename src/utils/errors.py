"""Errors the user must fix end the run with one clear sentence and exit status 2, not a traceback.

Config, data, paths, hardware and checkpoints are the user's to fix: every check raises a
`UserError` subclass (`ConfigError`, `CorpusError`, `CheckpointError`) whose message names the key,
file (with line or byte) or value, and the fix. `user_errors()` is the one place that turns them into
that line: train.py and eval.py wrap their job in it, `python -m src.tools.checkpoints` too. Any other
exception is a bug and keeps its traceback. HYDRA_FULL_ERROR=1 shows the full trace for user errors too.

Hydra wraps what a `_target_` raises in an InstantiationException, so the cause chain is searched.
In a multirun the job re-raises a short error instead of exiting: Hydra records that job as failed,
with the message, and runs the next (like `src.launch.timeouts.distributed_errors`).
Under DDP the config checks run before the ranks start and the data is first read in `prepare_data`
(rank 0 alone, the others wait and are stopped by `hydra_ddp.ddp_job` 5 s later), so one rank reports;
a rank other than 0 that finds an error prefixes it with its rank.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

from hydra.errors import CompactHydraException

log = logging.getLogger(__name__)
EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad config, data, path, hardware request or checkpoint: the message says what and how to fix it."""


class JobFailed(UserError, CompactHydraException):
    """A user error ending one job of a multirun: Hydra prints a CompactHydraException as its message
    alone (no traceback) after "Error executing job with overrides: [...]", once every job has run."""


class PathNotFound(UserError, FileNotFoundError):
    """A file or dir named in the config (tokenizer, pretrained model) that is not there."""


class CheckpointError(UserError, ValueError):
    """A file or dir given as a checkpoint that cannot be read or does not fit the model."""


def find_user_error(exc: BaseException) -> Optional[BaseException]:
    """`exc` itself or the UserError it was raised from (Hydra's instantiate wraps errors)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, UserError):
            return exc
        exc = exc.__cause__  # not __context__: a bug raised while handling a user error stays a bug
    return None


def translate(exc: BaseException, ckpt_path: Optional[str] = None) -> Optional[str]:
    """The one-line message for a user error, or None for a bug. Also knows library errors that are always
    the user's: a mandatory key left unset or an interpolation that cannot resolve (OmegaConf), a
    MisconfigurationException (Lightning), and a checkpoint whose tensors do not fit the model (torch)."""
    from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

    found = find_user_error(exc)
    if found is not None:
        return str(found)
    text = str(exc)
    if isinstance(exc, MissingMandatoryValue):
        key = getattr(exc, "full_key", "") or text
        return f"{key} must be set: pass {key}=... on the command line (see conf/)."
    if isinstance(exc, InterpolationResolutionError):  # e.g. ${oc.env:X} unset, or a resolver given a bad value
        key = getattr(exc, "full_key", "") or "a config value"
        return f"{key} could not be resolved: {text.splitlines()[0][:300]}. Check the keys and values it refers to."
    if type(exc).__name__ == "MisconfigurationException":  # Lightning's word for a config it cannot run
        return (
            f"Lightning refuses this config: {text.strip().splitlines()[0][:300]} Change the trainer.* or "
            "callbacks.* keys it names (see conf/)."
        )
    if isinstance(exc, RuntimeError) and "Error(s) in loading state_dict" in text:
        detail = next((line.strip() for line in text.splitlines()[1:] if line.strip()), "")[:300]
        return (
            f"The checkpoint ckpt_path={ckpt_path!r} does not fit this model ({detail}). Use the model "
            "config it was trained with (its model.* keys), or train without ckpt_path."
        )
    return None


def _ckpt_path(cfg: Optional[Any]) -> Optional[str]:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.select(cfg, "ckpt_path", default=None, throw_on_missing=False) if cfg is not None else None
    except Exception:  # noqa: BLE001  (an unresolvable value: name nothing rather than fail here)
        return None


def process_rank() -> int:
    """This process's global rank: torch.distributed's once it is up, else RANK (torchrun and Lightning's child
    ranks set it) or LOCAL_RANK, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def in_multirun() -> bool:
    """Inside a Hydra multirun job (`-m`): a failing job then re-raises for Hydra to record, instead of exiting."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


@contextmanager
def user_errors(cfg: Optional[Any] = None) -> Iterator[None]:
    """Log a user error once, as its message only, and exit 2 (in a multirun: fail this job only).
    `cfg` (the job's config) lets a checkpoint error name its ckpt_path."""
    try:
        yield
    except Exception as exc:
        message = translate(exc, _ckpt_path(cfg))
        if message is None:
            raise  # a bug: keep the traceback
        rank = process_rank()
        if rank == 0 or not getattr(find_user_error(exc), "same_on_every_rank", False):
            log.error(message if rank == 0 else f"Rank {rank}: {message}")
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if in_multirun():  # Hydra records this job as failed, with the message, and runs the next one
            raise JobFailed(message) from None
        sys.stderr.flush()
        raise SystemExit(EXIT_USER_ERROR) from None
