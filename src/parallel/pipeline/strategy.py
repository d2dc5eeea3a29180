"""trainer=pipeline: Lightning's ModelParallelStrategy on a (data_parallel, pipeline_parallel, tensor_parallel) mesh.

Lightning 2.6 has no pipeline support and its ModelParallelStrategy reads only its data-parallel dim,
so this subclass builds the mesh (src/parallel/mesh.py), splits the model (src/parallel/pipeline/schedule.py)
and runs the optimizer step itself (`own_loss`: the module's automatic_optimization is False under it), and
`training_step` here is schedule -> gradient sync -> clipping -> optimizer and LR step -> logging. The module's
own training_step is not used; its objective's loss (`loss_sum`, `n_targets`: src/lm/objectives/base.py), metrics,
optimizer and LR schedule are.

Logging: the loss exists on the last stage only. Its ranks hold their data-parallel shard's share of
the global batch's mean; one all-reduce (sum) over all ranks, others adding 0, gives every rank the
global batch's loss, so rank 0 logs the real value (an MoE model's router statistics ride in the same
all-reduce). Evaluation metrics are sums and counts (the objective's `add_sums`): ranks without the last
stage add (0, 0), so torchmetrics' sync over all ranks is exact.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.profiler import record_function

from src.checkpoint import safe_load
from src.checkpoint.sharded import ShardedCheckpoints
from src.parallel.capabilities import Capabilities
from src.parallel.mesh import OwnMesh
from src.parallel.pipeline.schedule import Pipeline, check_config, parallelize
from src.parallel.tensor.plan import layout
from src.utils.logging import TRAIN_LOSS_REDUCE

log = logging.getLogger(__name__)
METADATA = "meta.pt"  # what Lightning's ModelParallelStrategy names the non-tensor part of a DCP checkpoint


class PipelineStrategy(OwnMesh, ShardedCheckpoints, ModelParallelStrategy, Capabilities):
    """Pipeline stages over `pipeline_parallel_size` ranks; the remaining factor of the world is data parallel."""

    generation = None  # no rank holds the whole model: callbacks.generate_text skips itself
    check_config = staticmethod(check_config)  # run by src/run/checks.py before any process starts
    keys_dropout = (
        False  # splits a row's forward: a model with dropout is refused (src/lm/features/dropout.py, check_draws)
    )
    parallelizes = True  # applies src/parallel/parallelize.py to its stages (the model's configure_model does not)
    takes_plain_modules = False  # cuts a CausalLMLitModule's blocks into stages
    # its last stage computes the loss, and training_step below runs the step (automatic_optimization is False)
    own_loss = "its last stage computes the loss from each micro-batch's logits and labels alone"
    native_form = "dcp_flat"  # each rank writes its stages' tensors under their plain HF names

    def __init__(
        self,
        pipeline_parallel_size: int = 2,
        schedule: str = "GPipe",
        n_microbatches: int = 4,
        stages_per_rank: int = 1,
        gradient_clip_val: float = 1.0,
        tensor_parallel_size: int = 1,
        timeout: timedelta = default_pg_timeout,
    ) -> None:
        super().__init__(save_distributed_checkpoint=True, timeout=timeout)
        self.pipeline_parallel_size, self.schedule, self.n_microbatches = (
            pipeline_parallel_size,
            schedule,
            n_microbatches,
        )
        self.tensor_parallel_size = tensor_parallel_size
        self.stages_per_rank, self.gradient_clip_val = stages_per_rank, gradient_clip_val
        self.pipeline: Pipeline | None = None

    def mesh_dims(self) -> dict[str, int]:
        return {"pipeline_parallel": self.pipeline_parallel_size, "tensor_parallel": self.tensor_parallel_size}

    def setup(self, trainer) -> None:
        if self.pipeline is None:  # setup runs again for test after fit
            self.pipeline = parallelize(
                self.lightning_module,
                self.mesh,
                self.schedule,
                self.n_microbatches,
                self.stages_per_rank,
                self.root_device,
            )
        super().setup(trainer)

    # ---- steps ----

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        module, pipe = self.lightning_module, self.pipeline
        optimizer = module.optimizers()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # the global batch's targets, from the sampler order every rank shares (as token_mean_loss does under
        # DDP): no collective, no host sync; counted and all-reduced only for a train set without counts
        n_targets = module.step_total(batch_idx)
        if n_targets is None:
            counted = module.objective.n_targets(batch)
            dist.all_reduce(counted, group=pipe.data_group)
            n_targets = int(counted)
        optimizer.zero_grad()
        with self.precision_plugin.train_step_context():
            loss = pipe.run(
                batch["input_ids"], batch["labels"], True, 1.0 / max(n_targets, 1), batch.get("attention_mask")
            )
        sums = pipe.stat_sums()  # an MoE model's router statistics (None for others): summed over ranks alike
        values = loss[None] if sums is None else torch.cat([loss[None], sums.to(loss.dtype)])
        with record_function(TRAIN_LOSS_REDUCE):
            dist.all_reduce(values)  # last-stage ranks hold their shard's share; all others 0
        loss, sums = values[0], (None if sums is None else values[1:])
        pipe.sync_grads(params)
        pipe.clip_grads(params, self.gradient_clip_val)
        optimizer.step()
        scheduler = module.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        module.log_train_loss(loss, batch_idx, sums)
        return loss

    def _evaluate(self, batch: dict[str, torch.Tensor], metrics) -> None:
        objective = self.lightning_module.objective
        with torch.no_grad(), self.precision_plugin.val_step_context():
            loss = self.pipeline.run(batch["input_ids"], batch["labels"], False, 1.0, batch.get("attention_mask"))
        count = objective.n_targets(batch) if self.pipeline.reports_loss else torch.zeros((), dtype=torch.int64)
        objective.add_sums(metrics, loss, count)  # ranks that do not report the loss add (0, 0) to the synced sums

    def validation_step(self, batch, batch_idx, *args: Any) -> None:
        self._evaluate(batch, self.lightning_module.objective.val_metrics)

    def test_step(self, batch, batch_idx, *args: Any) -> None:
        self._evaluate(batch, self.lightning_module.objective.test_metrics)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "trainer=pipeline does not predict: export the checkpoint (src.tools.checkpoints "
            "export-hf) and predict with one process."
        )

    # ---- checkpoints: one DCP dir, each rank writing its stages' tensors under their plain HF names ----

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """Flattened (`state.<param name>.exp_avg`, ...): each rank's keys are its own, so DCP can merge them."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):  # Lightning's wrapper: its public `optimizer` is the torch one
            optimizer = optimizer.optimizer
        options = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.lightning_module, optimizer, options=options)

    def weight_layout(self) -> Optional[dict]:
        """With tensor parallel, trainer=tp's Linear layout (the tools turn it back into GPT-2's); else None."""
        tp = self.tensor_parallel_size
        return layout(self.lightning_module.hf_model.config, tp) if tp > 1 else None

    def load_own_checkpoint(self, checkpoint_path) -> dict[str, Any]:
        """Each rank reads its stages' weights and optimizer state; returns the rest (loops, LR schedule, ...)."""
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(str(checkpoint_path)))
        module = self.lightning_module
        state = {"state_dict": get_model_state_dict(module)}
        load(state, checkpoint_id=path)
        module.load_state_dict(state["state_dict"])
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        for i, optimizer in enumerate(self.optimizers):
            state = {f"optimizer_{i}": get_optimizer_state_dict(module, optimizer, options=options)}
            load(state, checkpoint_id=path)
            set_optimizer_state_dict(module, optimizer, optim_state_dict=state[f"optimizer_{i}"], options=options)
        return safe_load.load(path / METADATA, map_location="cpu")
