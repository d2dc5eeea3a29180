"""trainer=tp: Lightning's ModelParallelStrategy on a (data_parallel, tensor_parallel) mesh. Tensor parallel
within groups of `tensor_parallel_size` ranks (src/distributed/tensor_parallel.py), FSDP2 across the groups,
both applied by src/distributed/parallelize.py."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from omegaconf import OmegaConf

from src.distributed import resharding
from src.distributed.checkpointing import save_sharded
from src.distributed.layouts import LAYOUT_KEY, layout
from src.distributed.mesh import split_data_over
from src.distributed.parallelize import parallelize
from src.distributed.tensor_parallel import check_divisible, check_forward, check_plan
from src.utils.config import ConfigError, check_int, check_unsupported
from src.utils.hf_config import architecture


def data_and_tensor_sizes(world: int, tensor_parallel_size: int) -> tuple[int, int]:
    """(data_parallel, tensor_parallel) sizes of the mesh, which Lightning's ModelParallelStrategy builds with
    dims named data_parallel, tensor_parallel. The one place that shapes the mesh: swap it for
    src/distributed/mesh.py's named mesh when that lands."""

    check_int("trainer.strategy.tensor_parallel_size", tensor_parallel_size)
    if world % tensor_parallel_size:
        raise ConfigError(
            f"trainer.strategy.tensor_parallel_size={tensor_parallel_size} does not divide the "
            f"{world} ranks (trainer.devices x trainer.num_nodes): the ranks must be data_parallel x "
            "tensor_parallel; change one of them."
        )
    return world // tensor_parallel_size, tensor_parallel_size


def check_config(cfg: Any) -> None:
    """trainer=tp's checks on the composed config, before any rank starts (one sentence each)."""

    tp = OmegaConf.select(cfg, "trainer.strategy.tensor_parallel_size")
    devices, nodes = cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1)
    if isinstance(devices, int) and devices > 0 and isinstance(nodes, int):  # "auto", -1, lists: known only later
        data_and_tensor_sizes(devices * nodes, tp)
    model = cfg.model
    config = architecture(model)
    if config is not None:
        check_plan(config)
        if isinstance(tp, int) and tp > 0:
            check_divisible(config, tp)
    if model.get("compile", False) and model.get("gradient_checkpointing", False):
        raise ConfigError(
            "model.compile=true and model.gradient_checkpointing=true together are not supported with trainer=tp "
            "(torch.compile cannot yet save a tensor-parallel block for its recompute): turn one of them off."
        )
    check_unsupported(cfg, "tp", ("model.lora.enabled", "model.peft"))


class TensorParallelStrategy(ModelParallelStrategy):
    """Tensor parallel within groups of `tensor_parallel_size` ranks, data parallel (FSDP2) across groups.

    Every rank of a tensor-parallel group reads the same samples (samplers use the data_parallel dim
    only). Checkpoints are DCP dirs (each rank its shard), marked with our layout so that
    src/tools/checkpoints.py can give them back in HF GPT-2 form.
    """

    parallelizes = True  # applies src/distributed/parallelize.py itself (the model's configure_model does not)
    check_config = staticmethod(check_config)  # run by src/run/checks.py before any process starts

    def __init__(self, tensor_parallel_size: int = 2, timeout: timedelta = default_pg_timeout) -> None:
        super().__init__(save_distributed_checkpoint=True, timeout=timeout)
        self.tp_size = tensor_parallel_size

    def setup_environment(self) -> None:
        world = self.num_nodes * self.num_processes
        self._data_parallel_size, self._tensor_parallel_size = data_and_tensor_sizes(world, self.tp_size)
        super().setup_environment()  # Lightning's (data_parallel, tensor_parallel) mesh
        split_data_over(self.device_mesh)  # samplers deal samples over the data-parallel dim only

    def setup(self, trainer) -> None:
        module = self.lightning_module
        first = not getattr(module, "_tensor_parallel", False)  # setup runs again for test after fit
        if first:
            parallelize(
                module,
                tensor_parallel=self.device_mesh["tensor_parallel"],
                data_parallel=self.device_mesh["data_parallel"] if self._data_parallel_size > 1 else None,
                **module.wrappers(),
            )
            module._tensor_parallel = True
        super().setup(trainer)
        if first:
            check_forward(module)  # on its device: a split forward that fails is one sentence

    def teardown(self) -> None:
        split_data_over(None)
        super().teardown()

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """A DCP dir written beside `filepath` and renamed into place, marked with our weight layout."""
        entry = layout(self.lightning_module.config, self.tp_size)
        if entry is not None:
            checkpoint[LAYOUT_KEY] = entry
        save_sharded(
            self,
            lambda tmp: super(TensorParallelStrategy, self).save_checkpoint(checkpoint, tmp, storage_options),
            filepath,
        )

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """Its own DCP dirs (the same layout: any data-parallel size) through Lightning's resharding load; files,
        other strategies' dirs and GPT-2 dirs of another tensor-parallel size through the full form."""
        own = lambda: super(TensorParallelStrategy, self).load_checkpoint(checkpoint_path, weights_only)  # noqa: E731
        native = ("dcp", layout(self.lightning_module.config, self.tp_size))
        return resharding.load(self, checkpoint_path, native, own)
