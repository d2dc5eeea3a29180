"""Tests only: our DeepSpeed strategy on CPU / gloo. Lightning refuses DeepSpeed without CUDA
("only supported on CUDA GPUs"); skipping its two device checks is enough for ZeRO 1/2/3 and CPU
offload to run."""

from __future__ import annotations

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy

from src.parallel.deepspeed import DeepSpeedStrategy


def skip_shm_allreduce_build() -> None:
    """On a CPU accelerator, DeepSpeed's comm backend JIT-builds and loads its shared-memory all-reduce
    (`deepspeed_shm_comm`) in every process. Only `inference_all_reduce` (AutoTP inference) uses it; training
    reduces through torch.distributed. Marked incompatible, the backend skips it: no ~35 s build per clone,
    no load and no shared-memory segment per process."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def build_cpu_adam_without_debug_info() -> None:
    """DeepSpeed JIT-builds its CPU Adam (optimizer offload) with `-O3 -g`. The debug info changes no instruction
    but makes each of its two files 1.5x slower to compile (64 against 43 s of one core here, measured): without
    it, a fresh clone's tests build it ~40 s of CPU sooner. Tests only: the build goes to the tests' own
    extensions dir (conftest.torch_extensions_dir), and torch rebuilds an op whose flags changed."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    cxx_args = CPUAdamBuilder.cxx_args
    if not getattr(cxx_args, "without_debug_info", False):

        def without_g(self):
            return [a for a in cxx_args(self) if a != "-g"]

        without_g.without_debug_info = True
        CPUAdamBuilder.cxx_args = without_g


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    requires_cuda = False

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # Lightning's DeepSpeed version insists on a CUDAAccelerator

    def setup_distributed(self) -> None:  # as Lightning's, minus the check that device indices are GPU ranks
        reset_seed()
        self.set_world_ranks()
        skip_shm_allreduce_build()
        build_cpu_adam_without_debug_info()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        """As Lightning's, but DeepSpeed gets the local rank as device_rank (a CPU device has no index)."""
        import argparse

        import deepspeed

        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=filter(lambda p: p.requires_grad, model.parameters()),
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    def _initialize_deepspeed_inference(self, model) -> None:
        """As Lightning's (used by validate/test outside fit), with the local rank as device_rank:
        Lightning passes root_device.index, which is None for a CPU device."""
        import argparse

        import deepspeed

        initialize = deepspeed.initialize
        deepspeed.initialize = lambda args, **kwargs: initialize(
            args=argparse.Namespace(device_rank=self.local_rank), **kwargs
        )
        try:
            super()._initialize_deepspeed_inference(model)
        finally:
            deepspeed.initialize = initialize
