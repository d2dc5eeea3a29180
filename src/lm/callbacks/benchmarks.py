"""callbacks.benchmarks: lm-evaluation-harness tasks on the model being trained, every K optimizer steps.

src/lm/callbacks/harness.py's LM stands in front of the module's model (eval mode, no gradients, eager, then back to train
mode); every rank scores its share of the requests and all gather them in order, so each rank holds the same scores
and N ranks log what 1 process does. Each number is logged as `bench/<task>/<metric>` at the step, by rank 0, to every
logger. lm-eval seeds python, numpy and torch: their states are put back, so the training run is the one it would be
without the callback. Sharded strategies (FSDP2, ZeRO-3, tp, the pipeline) are refused by src/run/checks.py."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any, Optional

import lightning as L
import numpy as np
import torch

from src.lm.callbacks import harness as benchmarks
from src.utils.config import ConfigError


class Benchmarks(L.Callback):
    def __init__(
        self,
        tasks: list[str],
        every_n_steps: int = 1000,
        limit: Optional[float] = None,
        include_path: Optional[str] = None,
        num_fewshot: Optional[int] = None,
        seed: int = 0,
        batch_size: int = 8,
    ) -> None:
        self.every_n_steps, self.done = every_n_steps, -1
        self.cfg = SimpleNamespace(
            tasks=list(tasks),
            limit=limit,
            include_path=include_path,
            num_fewshot=num_fewshot,
            seed=seed,
            batch_size=batch_size,
        )

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        writes = getattr(getattr(pl_module, "objective", None), "generates", True)
        if not (writes and hasattr(getattr(pl_module, "model", None), "generate")):
            raise ConfigError(
                f"callbacks.benchmarks runs lm-eval tasks on a causal LM, not a {type(pl_module).__name__}: "
                "drop it (callbacks.benchmarks=null)."
            )

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_steps <= 0 or step == 0 or step % self.every_n_steps or step == self.done:
            return  # `done`: with gradient accumulation several batches end at one step
        self.done = step
        scores = benchmarks.scalars(self.evaluate(pl_module.model, trainer.datamodule.tokenizer))
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in scores.items()})
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(scores, step=step)

    def evaluate(self, model: torch.nn.Module, tokenizer: Any) -> dict[str, Any]:
        device = next(model.parameters()).device
        was_training, states = model.training, (random.getstate(), np.random.get_state())
        model.eval()
        try:
            with (
                torch.no_grad(),
                torch.compiler.set_stance("force_eager"),  # model.compile's graphs are the training forward's
                torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
            ):
                return benchmarks.evaluate(model, tokenizer, self.cfg)
        finally:
            model.train(was_training)
            random.setstate(states[0])
            np.random.set_state(states[1])
