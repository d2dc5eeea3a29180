"""trainer=fsdp: FSDP2 (`torch.distributed.fsdp.fully_shard`) over every rank, applied from outside the model by
src/parallel/parallelize.py. Lightning's `ModelParallelStrategy` runs it: it works on GPUs (NCCL) and on
CPU (gloo), where Lightning's FSDP1 `FSDPStrategy` refuses to start. With `expert_parallel_size` k > 1, a
mixture-of-experts model's experts are split over groups of k ranks (src/parallel/expert_parallel.py).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Optional

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from omegaconf import OmegaConf

from src.architectures.config import architecture
from src.checkpoint.sharded import ShardedCheckpoints
from src.parallel import expert_parallel
from src.parallel.capabilities import Capabilities
from src.parallel.mesh import OwnMesh
from src.parallel.parallelize import parallelize, parallelized
from src.parallel.sync_batchnorm import apply_layer_sync
from src.utils.config import ConfigError, world_size

log = logging.getLogger(__name__)


def check_config(cfg: Any) -> None:
    """trainer=fsdp's checks on the composed config, before any rank starts: expert parallelism's (one sentence)."""
    size = OmegaConf.select(cfg, "trainer.strategy.expert_parallel_size", default=1)
    config = architecture(cfg.model) if size != 1 else None
    expert_parallel.check_config(config, size, world_size(cfg.trainer))
    if size != 1 and cfg.trainer.get("gradient_clip_algorithm") not in (None, "norm"):
        raise ConfigError(
            f"trainer.gradient_clip_algorithm={cfg.trainer.gradient_clip_algorithm} with "
            f"trainer.strategy.expert_parallel_size={size}: clip by norm (the default), which expert parallelism "
            "computes over all its meshes."
        )


class FSDP2Strategy(OwnMesh, ShardedCheckpoints, ModelParallelStrategy, Capabilities):
    """Pure data-parallel FSDP2 over all ranks, with FSDP2's switches as config (activation checkpointing and
    compile are the model's: model.gradient_checkpointing, model.compile).

    With meta_init, train.py builds the model on the meta device (src/lm/init.py) and `setup`
    materialises each rank's shards after fully_shard: no rank ever holds the whole model.
    """

    materializes_shards = True  # the model's configure_model leaves a meta model to us
    parallelizes = True  # applies src/parallel/parallelize.py itself (the model's configure_model does not)
    takes_plain_modules = False  # shards LitModule.networks() and blocks(), materializes through LitModule
    generation = "lockstep"  # every rank gathers the parameters: all sample together
    check_config = staticmethod(check_config)  # run by src/run/checks.py before any process starts

    def __init__(
        self,
        reshard_after_forward: bool = True,
        param_dtype: Optional[str] = None,
        reduce_dtype: Optional[str] = None,
        cpu_offload: bool = False,
        save_distributed_checkpoint: bool = True,
        timeout: timedelta = default_pg_timeout,  # collective timeout (conf/trainer/fsdp.yaml)
        meta_init: bool = True,
        expert_parallel_size: int = 1,
    ) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, timeout=timeout)
        self.meta_init = meta_init  # read by train.py
        self.expert_parallel_size = expert_parallel_size
        self.save_distributed_checkpoint = save_distributed_checkpoint
        self.options = dict(
            reshard_after_forward=reshard_after_forward,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            cpu_offload=cpu_offload,
        )

    @property
    def grads_on_several_meshes(self) -> bool:  # the experts' mesh beside the data-parallel one
        return self.expert_parallel_size > 1

    def setup(self, trainer) -> None:
        if not parallelized(self.lightning_module):  # setup runs again for test after fit
            apply_layer_sync(self, self.lightning_module)  # trainer.plugins' SyncBatchNorm; Lightning skips FSDP2
            module = self.lightning_module
            experts = None
            if self.expert_parallel_size > 1:  # (efsdp, ep) over all ranks; each rank its own batch
                mesh = expert_parallel.expert_mesh(self.world_size, self.expert_parallel_size, self.root_device.type)
                experts = (mesh, self.device_mesh["tensor_parallel"])
            parallelize(
                module,
                data_parallel=self.device_mesh["data_parallel"],
                experts=experts,
                fsdp=self.options,
                **module.wrappers(),
            )
            self.lightning_module.materialize(self.root_device, sharded=True)  # a meta-device model's shards
        super().setup(trainer)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """A DCP dir (ShardedCheckpoints), or with save_distributed_checkpoint=false one file on rank 0, via
        trainer.plugins' AtomicCheckpointIO."""
        if self.save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        return ModelParallelStrategy.save_checkpoint(self, checkpoint, filepath, storage_options)
