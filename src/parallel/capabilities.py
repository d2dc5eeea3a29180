"""What a strategy tells the code around it, in one place: each capability with its default and its reader.

The template's strategies inherit `Capabilities` (last among their bases, so that Lightning's own attributes
win over a default here) and override what they do differently; Lightning's own
strategies (one device, DDP) declare nothing and get the defaults. Read them through `of`:

    of(trainer.strategy).meta_init          # an instance
    of(get_object(cfg.trainer.strategy._target_)).check_config   # or the class, before any process starts
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional


class Capabilities:
    meta_init: bool = False
    """train.py builds the model on the meta device (FSDP2, ZeRO-3): no rank ever holds the whole model's values;
    the strategy gives them (`materializes_shards`), or else the parameters are partitioned as their modules are made
    (DeepSpeed's zero.Init: ZeRO-3, where this is Lightning's `zero_stage_3`) and the model's configure_model builds
    it again."""

    materializes_shards: bool = False
    """The strategy gives a meta-built model its values itself, after sharding (FSDP2 calls
    LitModule.materialize); otherwise the model's configure_model does, for the whole model."""

    parallelizes: bool = False
    """The strategy applies src/parallel/parallelize.py itself, with its meshes (FSDP2, tensor parallel, the
    pipeline's stages); otherwise the model's configure_model applies the per-block wrappers (activation
    checkpointing, compile) without meshes."""

    generation: Optional[str] = "alone"
    """How text is sampled under it (callbacks.generate_text, generate.py): "alone", each rank holds the whole model
    and samples by itself (one device, DDP, ZeRO-1 and 2); "lockstep", no rank holds the whole parameters between
    steps (FSDP2, tensor parallel, ZeRO-3), so gathering them is collective and every rank samples, as many forwards;
    None, no rank runs the whole model (the pipeline's stages): nothing samples."""

    keys_dropout: bool = True
    """Each rank runs whole rows through the whole model, so a row's dropout masks keyed by its sample
    (src/core/dropout.py) are those one process draws. False (tensor parallel splits a row's heads and widths, the
    pipeline's schedule its micro-batches over stages): a model with dropout is refused."""

    grads_on_several_meshes: bool = False
    """Gradients are DTensors on more than one device mesh (expert parallelism: the experts' own mesh beside the
    data-parallel one), which torch's clip_grad_norm_ cannot stack: LitModule clips with
    src/parallel/expert_parallel.py's `clip_grad_norm`, one norm per mesh."""

    optimizer_class: Optional[type] = None
    """The optimizer class the model's optimizer must be instead of its configured one (DeepSpeed's CPU Adam
    under optimizer offload), or None."""

    own_loss: ClassVar[Optional[str]] = None
    """Why the strategy computes the loss itself, where it does (the pipeline's last stage, from each micro-batch's
    logits and labels, through the objective's `loss_sum` and `n_targets`): an objective whose loss is not such a
    sum is refused under it (an objective's `refused_under`). Such a strategy runs the whole training step itself
    (schedule, gradient sync, clipping, optimizer and LR step): LitModule's `automatic_optimization` is False under
    it, so Lightning calls the strategy's training_step and runs no backward or optimizer step of its own."""

    split_vocabulary: ClassVar[Optional[str]] = None
    """Why no rank holds the output layer's whole rows, where it is so (tensor parallel splits it over the
    vocabulary): an objective that reads a scalar head is refused under it."""

    no_sampling: ClassVar[Optional[str]] = None
    """Why the model cannot sample text under it, where it cannot: an objective that samples (GRPO) is refused."""

    checkpoint_form: ClassVar[str] = "file"
    """What its checkpoints are: "file" (one file, rank 0's), "dcp" (a DCP dir of every rank's shards: FSDP2, tensor
    parallel, the pipeline; src/checkpoint/sharded.py) or "deepspeed" (a ZeRO dir, which only DeepSpeed resumes:
    src/checkpoint/latest.py). A sharded strategy reads its own dirs itself; eval.py consolidates a sharded
    checkpoint into one file for a "file" one."""

    zero_stages: ClassVar[bool] = False
    """trainer.strategy.stage picks a DeepSpeed ZeRO stage (3 partitions the parameters): src/run/checks.py reads it
    in the config, before any process starts."""

    data_mesh: Optional[Any] = None
    """The 1-D device mesh the samplers deal the data over (the data-parallel dim of the strategy's own mesh, so that
    the ranks of one pipeline or tensor-parallel group read the same samples), or None: over all ranks. Read through
    src/parallel/samplers.py's `rank_and_world(trainer)`."""

    grads_whole: bool = False
    """Every rank holds every gradient whole (one device, DDP): callbacks.divergence can skip a step by zeroing them.
    Lightning's own one-device and DDP strategies declare it through `of`."""

    takes_plain_modules: ClassVar[bool] = True
    """Any LightningModule trains under it, a plain one too: it asks nothing of the module (one device, DDP). False
    (FSDP2, DeepSpeed, tensor parallel, the pipeline): it shards through LitModule's interface (src/core/module.py:
    blocks(), networks(), materialize()), so src/run/checks.py refuses another module before any process starts."""

    requires_cuda: ClassVar[Optional[str]] = None
    """Where the strategy refuses a CPU run (DeepSpeed, Lightning's FSDP1), the sentence src/run/checks.py says
    before any process starts."""

    check_config: ClassVar[Optional[Callable[[Any], None]]] = None
    """The strategy's own checks of the composed config (one sentence each), run by src/run/checks.py before any
    process starts; set as `staticmethod(fn)`."""


class _Replicated(Capabilities):
    """Lightning's own one-device and DDP strategies: every rank (the one) holds the whole model and gradients."""

    grads_whole = True


DEEPSPEED_NEEDS_CUDA = (
    "trainer=deepspeed needs CUDA GPUs (DeepSpeed refuses CPU) and none is visible here. "
    "Use trainer=ddp (2 CPU processes) on this machine."
)


class _LightningDeepSpeed(_Replicated):
    """Lightning's own DeepSpeed strategy (a DDP strategy to Lightning), named in the config or by its registry
    names ("deepspeed_stage_2", ...)."""

    requires_cuda = DEEPSPEED_NEEDS_CUDA


class _LightningFSDP1(Capabilities):
    requires_cuda = (
        "Lightning's FSDP1 strategy ('fsdp') needs CUDA GPUs and none is visible here. "
        "Use trainer=fsdp (FSDP2, runs on CPU too) or trainer=ddp."
    )


def of(strategy: Any) -> Any:
    """`strategy` (an instance, a class, or a name in Lightning's strategy registry: "ddp", "fsdp", ...) when it
    declares its capabilities, else the defaults (with `grads_whole` for Lightning's one-device and DDP strategies,
    `requires_cuda` for its DeepSpeed and FSDP1 ones)."""
    from lightning.pytorch.strategies import (
        DDPStrategy,
        DeepSpeedStrategy,
        FSDPStrategy,
        SingleDeviceStrategy,
        StrategyRegistry,
    )

    if isinstance(strategy, str):
        strategy = StrategyRegistry[strategy]["strategy"] if strategy in StrategyRegistry else None
    declared = isinstance(strategy, Capabilities) or (isinstance(strategy, type) and issubclass(strategy, Capabilities))
    if declared:
        return strategy
    kind = strategy if isinstance(strategy, type) else type(strategy)
    for lightnings, caps in ((DeepSpeedStrategy, _LightningDeepSpeed), (FSDPStrategy, _LightningFSDP1)):
        if issubclass(kind, lightnings):
            return caps
    return _Replicated if issubclass(kind, (SingleDeviceStrategy, DDPStrategy)) else Capabilities


def cluster_environment(strategy: Any) -> Optional[Any]:
    """The cluster environment a multi-process strategy runs in (SLURM's, torchrun's, Lightning's own launcher's);
    None for one device."""
    from lightning.pytorch.strategies import ParallelStrategy

    return strategy.cluster_environment if isinstance(strategy, ParallelStrategy) else None
