"""trainer=tp: Lightning's ModelParallelStrategy on a (data_parallel, tensor_parallel) mesh. Tensor parallel
within groups of `tensor_parallel_size` ranks (src/parallel/tensor/plan.py), FSDP2 across the groups,
both applied by src/parallel/parallelize.py."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from omegaconf import OmegaConf

from src.architectures.config import architecture
from src.checkpoint.sharded import ShardedCheckpoints
from src.parallel.capabilities import Capabilities
from src.parallel.contract import implemented_by
from src.parallel.mesh import OwnMesh, mesh_sizes
from src.parallel.parallelize import parallelize, parallelized
from src.parallel.tensor.plan import check_divisible, check_forward, check_plan, layout
from src.utils.config import ConfigError, check_int, check_unsupported, world_size


def check_config(cfg: Any) -> None:
    """trainer=tp's checks on the composed config, before any rank starts (one sentence each)."""

    tp = OmegaConf.select(cfg, "trainer.strategy.tensor_parallel_size")
    check_int("trainer.strategy.tensor_parallel_size", tp)
    world = world_size(cfg.trainer)
    if world is not None:  # "auto", -1: known only later
        mesh_sizes(world, tensor_parallel=tp)
    model = cfg.model
    config = architecture(model)
    if config is None or not implemented_by(model):
        raise ConfigError(
            "trainer=tp splits transformers decoder LMs only (model=gpt2, llama, qwen2, mistral or causal_lm), and "
            "this model is not one: use trainer=ddp, or trainer=fsdp to shard it."
        )
    check_plan(config)
    if isinstance(tp, int) and tp > 0:
        check_divisible(config, tp)
    if model.get("compile", False) and model.get("gradient_checkpointing", False):
        raise ConfigError(
            "model.compile=true and model.gradient_checkpointing=true together are not supported with trainer=tp "
            "(torch.compile cannot yet save a tensor-parallel block for its recompute): turn one of them off."
        )
    check_unsupported(cfg, "tp", ("model.lora.enabled", "model.peft"))


class TensorParallelStrategy(OwnMesh, ShardedCheckpoints, ModelParallelStrategy, Capabilities):
    """Tensor parallel within groups of `tensor_parallel_size` ranks, data parallel (FSDP2) across groups.

    Every rank of a tensor-parallel group reads the same samples (samplers use the data_parallel dim
    only). Checkpoints are DCP dirs (each rank its shard), marked with our layout so that
    src/checkpoint/convert.py can give them back in HF GPT-2 form.
    """

    keys_dropout = (
        False  # splits a row's forward: a model with dropout is refused (src/lm/features/dropout.py, check_draws)
    )
    parallelizes = True  # applies src/parallel/parallelize.py itself (the model's configure_model does not)
    takes_plain_modules = False  # splits LitModule.blocks()
    split_vocabulary = "the model's tp plan splits its output layer over the vocabulary"
    no_sampling = "sampling is not supported there"
    generation = "lockstep"  # every rank gathers the parameters: all sample together
    check_config = staticmethod(check_config)  # run by src/run/checks.py before any process starts

    def __init__(self, tensor_parallel_size: int = 2, timeout: timedelta = default_pg_timeout) -> None:
        super().__init__(save_distributed_checkpoint=True, timeout=timeout)
        self.tp_size = tensor_parallel_size

    def mesh_dims(self) -> dict[str, int]:
        return {"tensor_parallel": self.tp_size}

    def setup(self, trainer) -> None:
        module = self.lightning_module
        first = not parallelized(module)  # setup runs again for test after fit
        if first:
            data = self.mesh["data_parallel"]
            parallelize(
                module,
                tensor_parallel=self.mesh["tensor_parallel"],
                data_parallel=data if data.size() > 1 else None,
                **module.wrappers(),
            )
        super().setup(trainer)
        if first:
            check_forward(module)  # on its device: a split forward that fails is one sentence

    def weight_layout(self) -> Optional[dict]:
        """Its DCP dirs are marked with its Linear layout: src/checkpoint/convert.py gives them back in HF form."""
        return layout(self.lightning_module.hf_model.config, self.tp_size)
