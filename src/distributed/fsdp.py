"""FSDP2 (`torch.distributed.fsdp.fully_shard`) applied from outside the model, in one place.

Like torchtitan's `parallelize`: the model only says which modules are its repeated blocks
(`LitModule.blocks()`); this file decides how they are sharded, checkpointed and cast. Lightning's
`ModelParallelStrategy` runs it: it works on GPUs (NCCL) and on CPU (gloo), where Lightning's
FSDP1 `FSDPStrategy` refuses to start.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Optional

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from src.distributed import resharding
from src.distributed.checkpointing import save_sharded
from src.distributed.sync_batchnorm import apply_layer_sync

log = logging.getLogger(__name__)

DTYPES = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parallelize(
    module: nn.Module,
    mesh: DeviceMesh,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
    param_dtype: Optional[str] = None,
    reduce_dtype: Optional[str] = None,
    cpu_offload: bool = False,
) -> nn.Module:
    """Shard each block, then the rest (embeddings, head, tied weights) as one root unit.

    `module` is a LitModule: `blocks()` lists its repeated blocks, `networks()` the modules whose
    forward the steps call (each must be a root, or its parameters would never be gathered).

    reshard_after_forward=True frees gathered parameters after each block's forward (ZeRO-3-like,
    least memory); False keeps them until backward (ZeRO-2-like, one all-gather less per block).
    """
    for dtype in (param_dtype, reduce_dtype):
        if dtype not in DTYPES:
            raise ValueError(f"FSDP dtype {dtype!r}: use one of {[k for k in DTYPES if k]} or null.")
    policy = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype]),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    blocks = module.blocks()
    if not blocks:
        raise ValueError(f"{type(module).__name__}.blocks() returned no blocks to shard.")
    for parent, name, block in blocks:
        if activation_checkpointing:  # recompute the block's activations in backward instead of storing them
            block = checkpoint_wrapper(block)
            parent.register_module(name, block)
        fully_shard(block, reshard_after_forward=reshard_after_forward, **policy)
    for network in module.networks():  # the trained network; frozen ones (DPO's reference) are roots of their own
        fully_shard(network, reshard_after_forward=reshard_after_forward, **policy)
    log.info(
        f"FSDP2: {len(blocks)} blocks + root sharded over {mesh.size()} rank(s); "
        f"reshard_after_forward={reshard_after_forward}, activation_checkpointing={activation_checkpointing}, "
        f"param_dtype={param_dtype}, reduce_dtype={reduce_dtype}, cpu_offload={cpu_offload}"
    )
    return module


class FSDP2Strategy(ModelParallelStrategy):
    """Pure data-parallel FSDP2 over all ranks, with the switches of `parallelize` as config.

    With meta_init, train.py builds the model on the meta device (src/models/init.py) and `setup`
    materialises each rank's shards after fully_shard: no rank ever holds the whole model.
    """

    materializes_shards = True  # the model's configure_model leaves a meta model to us

    def __init__(
        self,
        reshard_after_forward: bool = True,
        activation_checkpointing: bool = False,
        param_dtype: Optional[str] = None,
        reduce_dtype: Optional[str] = None,
        cpu_offload: bool = False,
        save_distributed_checkpoint: bool = True,
        timeout: timedelta = default_pg_timeout,  # collective timeout (conf/trainer/fsdp.yaml)
        meta_init: bool = True,
    ) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, timeout=timeout)
        self.meta_init = meta_init  # read by train.py
        self.save_distributed_checkpoint = save_distributed_checkpoint
        self.options = dict(
            reshard_after_forward=reshard_after_forward,
            activation_checkpointing=activation_checkpointing,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            cpu_offload=cpu_offload,
        )

    def setup_environment(self) -> None:
        # One data-parallel dim over every rank (Lightning's default would use the devices for tensor parallelism).
        self._data_parallel_size, self._tensor_parallel_size = self.num_nodes * self.num_processes, 1
        super().setup_environment()

    def setup(self, trainer) -> None:
        if not isinstance(self.lightning_module.network(), FSDPModule):  # setup runs again for test after fit
            apply_layer_sync(self, self.lightning_module)  # trainer.plugins' SyncBatchNorm; Lightning skips FSDP2
            parallelize(self.lightning_module, self.device_mesh["data_parallel"], **self.options)
            self.lightning_module.materialize(self.root_device, sharded=True)  # a meta-device model's shards
        super().setup(trainer)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """The DCP dir is written beside `filepath` and renamed into place once every shard is on disk."""
        if not self.save_distributed_checkpoint:  # one file on rank 0, via trainer.plugins' AtomicCheckpointIO
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        save_sharded(
            self, lambda tmp: super(FSDP2Strategy, self).save_checkpoint(checkpoint, tmp, storage_options), filepath
        )

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """Its own DCP dirs through Lightning's resharding load (any N); files and other strategies' dirs through
        the full form (src/distributed/resharding.py)."""
        own = lambda: super(FSDP2Strategy, self).load_checkpoint(checkpoint_path, weights_only)  # noqa: E731
        return resharding.load(self, checkpoint_path, ("dcp", None), own)
