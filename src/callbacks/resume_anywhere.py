"""What every checkpoint stores so that it resumes anywhere, and what resuming does with a checkpoint of another shape.

The data position is global: a checkpoint stores how many samples of the epoch's one global permutation were
consumed (POSITION_KEY), not per-rank offsets, so the next global batch after resuming on M ranks is the one the
uninterrupted run would have drawn, and each rank's micro-batch is recomputed from the unchanged global batch.
Moving the weights and optimizer state between forms is src/checkpoint/resharding.py's.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from lightning.pytorch import Callback
from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

from src.checkpoint.resharding import NAMES_KEY, fit_to, is_named, param_names
from src.utils.config import ConfigError

log = logging.getLogger(__name__)

POSITION_KEY = "data_position"  # the epoch's samples consumed and the batch shape that consumed them


class ResumeAnywhere(Callback):
    """Stores what a resume on other ranks needs, and adapts a checkpoint of another shape when it is resumed.

    Saving: the optimizers' parameter names (NAMES_KEY) and the data position (POSITION_KEY): the samples of
    the epoch's one global permutation already consumed, the global batch, and the samples one per-rank batch
    index stands for (micro-batch x data-parallel ranks).

    Resuming, before Lightning restores its loops: when the new run's micro-batch x ranks differs (another
    accumulation, or another global batch), Lightning's batch counters are rescaled so that the sampler skips
    exactly the samples consumed and the accumulation boundaries fall where they did. Another
    data.global_batch_size is refused unless `+resume_with_new_batch=true`. Once the optimizers exist, a named
    optimizer state (from the full form, see AnyFormCheckpointIO) is loaded into them and handed to Lightning
    numbered, as it expects.
    """

    def __init__(self, allow_new_batch: bool = False) -> None:
        self.allow_new_batch = allow_new_batch
        self.checkpoint: Optional[dict] = None

    @staticmethod
    def batch_shape(trainer: Any) -> Optional[tuple[int, int]]:
        """(global batch, samples a per-rank batch index stands for), or None for a datamodule without them."""
        dm = trainer.datamodule
        if not hasattr(dm, "samples_per_batch") or dm.batch_size is None:
            return None
        return dm.global_batch_size, dm.samples_per_batch()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        names = {id(p) for p in pl_module.parameters()}
        if all(id(p) in names for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]):
            checkpoint[NAMES_KEY] = [param_names(pl_module, opt) for opt in trainer.optimizers]
        # else DeepSpeed: its optimizer holds flat partitions, not the module's parameters (its dirs resume only
        # under DeepSpeed: check_resume)
        shape = self.batch_shape(trainer)
        if shape is not None:
            done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
            checkpoint[POSITION_KEY] = {
                "epoch": trainer.current_epoch,
                "samples": done * shape[1],
                "global_batch_size": shape[0],
                "per_batch": shape[1],
            }

    @staticmethod
    def move_step_count(loops: dict, automatic: bool) -> None:
        """trainer=pipeline steps the optimizer itself (Lightning's manual optimization) and counts its steps in
        another loop than automatic optimization does: a checkpoint of one resumed under the other moves them."""
        auto = loops["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]
        manual = loops["epoch_loop.manual_optimization.optim_step_progress"]
        source, target = (manual, auto["step"]) if automatic else (auto["step"], manual)
        if source["total"]["completed"] == 0 or target["total"]["completed"] > 0:
            return
        for scope in ("total", "current"):
            target[scope] = dict(source[scope])
            source[scope] = {field: 0 for field in source[scope]}
            if automatic:
                steps = target[scope]["completed"]
                auto["zero_grad"][scope] = {"ready": steps, "started": steps, "completed": steps}

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        self.checkpoint = checkpoint
        if "loops" in checkpoint:
            self.move_step_count(checkpoint["loops"]["fit_loop"], pl_module.automatic_optimization)
        position, shape = checkpoint.get(POSITION_KEY), self.batch_shape(trainer)
        if position is None or shape is None or trainer.state.fn != "fit":
            return
        (batch, per_batch), samples = shape, position["samples"]
        if batch != position["global_batch_size"] and not self.allow_new_batch:
            raise ConfigError(
                f"The checkpoint was trained with data.global_batch_size={position['global_batch_size']} and this "
                f"run has {batch}: keep {position['global_batch_size']} to continue exactly (any device count it "
                "divides into), or add +resume_with_new_batch=true to continue with the new batch on purpose."
            )
        if per_batch == position["per_batch"]:
            return
        if samples % per_batch:
            if batch == position["global_batch_size"]:
                raise ConfigError(
                    f"The checkpoint stopped {samples} samples into its epoch, in the middle of a gradient "
                    f"accumulation, which {per_batch} samples per batch index cannot continue: resume with the "
                    "checkpoint's trainer.accumulate_grad_batches."
                )
            log.warning(f"{samples % per_batch} samples of the interrupted epoch are skipped to align the new batch")
        if batch != position["global_batch_size"]:
            log.warning(
                f"+resume_with_new_batch: from step {checkpoint['global_step']} on, batches of {batch} samples "
                f"(the checkpoint's: {position['global_batch_size']}) in the same epoch order: from here the run "
                "differs from one that kept the old batch"
            )
        progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
        old, new = dict(progress["current"]), samples // per_batch
        for field in ("ready", "started", "processed", "completed"):
            value = new - (old["processed"] - old[field])  # completed trails processed by the batch being saved
            progress["total"][field] += value - old[field]
            progress["current"][field] = value

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """After the strategy made the optimizers, before Lightning loads their state: a named state from the
        full form goes in here, and Lightning gets it back numbered (its own load is then a no-op copy)."""
        ckpt, self.checkpoint = self.checkpoint, None
        states = (ckpt or {}).get("optimizer_states") or []
        if not states or not all("param_groups" in s and is_named(s) and s["param_groups"] for s in states):
            return
        for i, optimizer in enumerate(trainer.optimizers):
            set_optimizer_state_dict(pl_module, optimizer, optim_state_dict=fit_to(states[i], pl_module, optimizer))
            ckpt["optimizer_states"][i] = optimizer.state_dict()
