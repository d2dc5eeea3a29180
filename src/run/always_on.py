"""The callbacks a script adds to every run, whatever conf/callbacks/ says: the one list of them, each script's own.

train.py puts them after conf/callbacks/'s (`callbacks=none` leaves these on); eval.py and generate.py compose no
callbacks group, so these are all they have.
"""

from __future__ import annotations

from typing import Literal

import lightning as L
from omegaconf import DictConfig

from src.callbacks.essentials import ConfigInCheckpoint, CpuThreadsPerRank, StepsInProgressBar
from src.callbacks.resume_anywhere import ResumeAnywhere
from src.callbacks.trackers import TrackerRuns
from src.callbacks.user_module import UserModule


def always_on(script: Literal["train", "eval", "generate"], cfg: DictConfig) -> list[L.Callback]:
    """`script`'s callbacks, in the order the Trainer runs them."""
    seed = cfg.get("seed") or 0
    if script == "generate":
        return [CpuThreadsPerRank()]  # each CPU rank its share of the cores
    if script == "eval":
        return [CpuThreadsPerRank(), UserModule(seed)]  # self.log synced over the ranks
    if script != "train":
        raise ValueError(f"always_on: no script {script!r} (train, eval or generate)")
    return [
        CpuThreadsPerRank(),
        ConfigInCheckpoint(cfg),  # the model and data config: eval.py rebuilds what trained
        StepsInProgressBar(),
        ResumeAnywhere(allow_new_batch=cfg.get("resume_with_new_batch", False)),  # resume on another N or strategy
        TrackerRuns(),  # MLflow / W&B: the run's id in every checkpoint
        UserModule(seed, cfg.compile_dropout, cfg.get("optimized_metric")),  # self.log synced, dropout keyed
    ]
