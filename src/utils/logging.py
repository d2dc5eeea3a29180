"""Console and file log lines that name their rank (with N processes, "which one said that?" matters), and a
CSV logger that keeps a resumed run's history."""

from __future__ import annotations

import csv
import logging
import os
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_only

# The torch.profiler range around the train-loss all-reduce of logging steps: callbacks.comm files the
# collectives inside it under "logging" (src/core/module.py, src/parallel/pipeline/strategy.py open it).
TRAIN_LOSS_REDUCE = "train/loss all-reduce"


class RankFilter(logging.Filter):
    """Adds `%(rank)s` to every record: the global rank (Lightning sets it once the process group exists)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = getattr(rank_zero_only, "rank", 0)
        return True


class DropTips(logging.Filter):
    """Drops Lightning's advertisement for its cloud logger (a rank_zero_info line in every run)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in str(record.msg)


def quiet_console() -> None:
    """What does not belong in `python train.py`'s output: Lightning's litlogger tip, its model-summary warning that
    bf16 sizes are estimated in 32 bits, and its use of a torch pytree API that torch 2.13 deprecates."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(DropTips())
    warnings.filterwarnings("ignore", message=r"Precision .* is not supported by the model summary")
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


class BelowError(logging.Filter):
    """Lets through records below ERROR: the console handler's filter, so that errors go to stderr only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


class ResumableCSVLogger(CSVLogger):
    """Lightning's CSVLogger, except that a run resumed in its run dir (resume=auto after a requeue or a crash)
    keeps csv/metrics.csv's history, every step once.

    Lightning's writer deletes the metrics.csv it finds ("Previous log files in this directory will be deleted"),
    so a requeued job kept only the steps after its requeue. Here the file is moved aside while the writer
    starts and put back, and the writer is told its header (its public `metrics_keys`), so the next rows are
    appended under it (a new column rewrites the file with every row). The steps a crashed attempt logged after
    its last checkpoint are trained again: the resumed attempt's first row (step s) drops the kept rows of steps
    s and later, so every step is in the file once, with the values of the run that went on.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._history_kept, self._resumed = False, False

    @property
    def experiment(self) -> Any:
        if self._history_kept or rank_zero_only.rank != 0:  # the other ranks get Lightning's no-op writer
            return super().experiment
        path = Path(self.log_dir) / "metrics.csv"
        aside = path.with_name("metrics.csv.resuming")  # also where an attempt killed just here left it
        if path.is_file():
            os.replace(path, aside)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
            writer = super().experiment
        if aside.is_file():
            os.replace(aside, path)
            with path.open(newline="") as f:
                writer.metrics_keys = next(csv.reader(f), [])
            self._resumed = True
        self._history_kept = True
        return writer

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        writer = self.experiment
        if self._resumed and step is not None:
            self._resumed = False
            writer.save()  # rows still in memory first (none yet, or the hparams')
            drop_rows_from(Path(self.log_dir) / "metrics.csv", step)
        super().log_metrics(metrics, step)


def drop_rows_from(path: Path, step: int) -> None:
    """Rewrites a metrics.csv without its rows of `step` and later (written to a temporary file and renamed)."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames or [], [r for r in reader if not r.get("step") or int(r["step"]) < step]
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)
