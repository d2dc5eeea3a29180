"""What a strategy tells the code around it, in one place: each capability with its default and its reader.

The template's strategies inherit `Capabilities` (last among their bases, so that Lightning's own attributes,
such as DeepSpeed's `zero_stage_3` property, win) and override what they do differently; Lightning's own
strategies (one device, DDP) declare nothing and get the defaults. Read them through `of`:

    of(trainer.strategy).meta_init          # an instance
    of(get_object(cfg.trainer.strategy._target_)).check_config   # or the class, before any process starts
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional


class Capabilities:
    meta_init: bool = False
    """train.py builds the model on the meta device (FSDP2, ZeRO-3): no rank ever holds the whole model's values;
    the strategy (`materializes_shards`) or the model's configure_model gives them."""

    materializes_shards: bool = False
    """The strategy gives a meta-built model its values itself, after sharding (FSDP2 calls
    LitModule.materialize); otherwise the model's configure_model does, for the whole model."""

    parallelizes: bool = False
    """The strategy applies src/parallel/parallelize.py itself, with its meshes (FSDP2, tensor parallel, the
    pipeline's stages); otherwise the model's configure_model applies the per-block wrappers (activation
    checkpointing, compile) without meshes."""

    zero_stage_3: bool = False
    """Parameters are partitioned as their modules are made (DeepSpeed's zero.Init, Lightning's own property):
    the model is built again inside configure_model."""

    can_generate: bool = True
    """Some rank holds the whole model, so callbacks.generate_text can sample (not the pipeline's stages)."""

    keys_dropout: bool = True
    """Each rank runs whole rows through the whole model, so a row's dropout masks keyed by its sample
    (src/models/dropout.py) are those one process draws. False (tensor parallel splits a row's heads and widths, the
    pipeline's schedule its micro-batches over stages): a model with dropout is refused."""

    grads_on_several_meshes: bool = False
    """Gradients are DTensors on more than one device mesh (expert parallelism: the experts' own mesh beside the
    data-parallel one), which torch's clip_grad_norm_ cannot stack: LitModule clips with
    src/parallel/expert_parallel.py's `clip_grad_norm`, one norm per mesh."""

    optimizer_class: Optional[type] = None
    """The optimizer class the model's optimizer must be instead of its configured one (DeepSpeed's CPU Adam
    under optimizer offload), or None."""

    takes_plain_modules: ClassVar[bool] = True
    """Any LightningModule trains under it, a plain one too: it asks nothing of the module (one device, DDP). False
    (FSDP2, DeepSpeed, tensor parallel, the pipeline): it shards through LitModule's interface (src/models/base.py:
    blocks(), networks(), materialize()), so src/run/checks.py refuses another module before any process starts."""

    requires_cuda: ClassVar[bool] = False
    """The strategy refuses a CPU run (Lightning's DeepSpeed): src/run/checks.py says so before any process starts."""

    check_config: ClassVar[Optional[Callable[[Any], None]]] = None
    """The strategy's own checks of the composed config (one sentence each), run by src/run/checks.py before any
    process starts; set as `staticmethod(fn)`."""


def of(strategy: Any) -> Any:
    """`strategy` (an instance or a class) when it declares its capabilities, else the defaults."""
    declared = isinstance(strategy, Capabilities) or (isinstance(strategy, type) and issubclass(strategy, Capabilities))
    return strategy if declared else Capabilities
