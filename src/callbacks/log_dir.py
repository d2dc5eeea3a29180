"""A Hydra callback: a paths.log_dir Hydra cannot make is one sentence, before the job starts."""

from __future__ import annotations

import sys
from typing import Any

from hydra.experimental.callback import Callback

from src.utils.errors import EXIT_USER_ERROR


class LogDirCheck(Callback):
    """A Hydra callback (conf/hydra/default.yaml): `paths.log_dir` inside a file ends the run with one sentence on
    stderr and exit 2. Hydra makes the run dir before the job starts, so `user_errors` never sees its
    NotADirectoryError, which Hydra printed with a traceback."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        self.check(config)

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self.check(config)

    @staticmethod
    def check(config: Any) -> None:
        from pathlib import Path

        from omegaconf import OmegaConf

        log_dir = OmegaConf.select(config, "paths.log_dir", default=None, throw_on_missing=False)
        if not isinstance(log_dir, str):
            return
        existing = Path(log_dir).absolute()
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            print(
                f"[ERROR] - paths.log_dir={log_dir} is inside {existing}, which is a file, not a directory: pick "
                "another paths.log_dir.",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(EXIT_USER_ERROR)
