"""Console and file log lines that name their rank: with N processes, "which one said that?" matters."""

from __future__ import annotations

import logging

from lightning.pytorch.utilities import rank_zero_only

# The torch.profiler range around the train-loss all-reduce of logging steps: callbacks.comm files the
# collectives inside it under "logging" (src/models/base.py, src/distributed/pipeline_strategy.py open it).
TRAIN_LOSS_REDUCE = "train/loss all-reduce"


class RankFilter(logging.Filter):
    """Adds `%(rank)s` to every record: the global rank (Lightning sets it once the process group exists)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = getattr(rank_zero_only, "rank", 0)
        return True
