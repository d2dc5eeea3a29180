"""The one place that applies parallelism and its companions to a model, from outside it (torchtitan's
`parallelize`), in this order:

    0. expert parallel    split an MoE model's experts over groups of data-parallel ranks (src/parallel/expert_parallel.py)
    1. tensor parallel    split each block's matrices over the `tensor_parallel` ranks (src/parallel/tensor/plan.py)
    2. activation ckpt    recompute each block's activations in backward instead of storing them
    3. compile            torch.compile, in place: each whole network (with no mesh: DDP, one device, ZeRO-1/2),
                          else each block (and, with no mesh, the output projection)
    4. FSDP2              shard each experts module over its copies (expert parallel), each block, then the rest as
                          one root unit, over the `data_parallel` ranks

Why this order: compile must see the final (tensor-parallel, checkpointed) block to trace it; FSDP2's
hooks must sit outside the compiled block, where they gather its parameters before it runs.

Every strategy reaches this function: FSDP2Strategy, TensorParallelStrategy and the pipeline (per stage)
call it with their meshes (they set `parallelizes = True`); under DDP, one device and DeepSpeed the model's
`configure_model` calls it without meshes (activation checkpointing and compile only; `whole_model=False` under
ZeRO-3, whose gathering hooks sit on every module). The model only says
which modules are its repeated blocks (`LitModule.blocks()`) and which networks its steps call
(`networks()`); the switches come from `model.gradient_checkpointing` and `model.compile`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from src.parallel import compiled_attention, expert_parallel
from src.parallel.tensor.plan import split_blocks
from src.utils.config import ConfigError

log = logging.getLogger(__name__)

DTYPES = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Block = tuple[nn.Module, str, nn.Module]  # (parent, name, block), as LitModule.blocks() lists them


def parallelize(
    module: Any,
    *,
    tensor_parallel: Optional[DeviceMesh] = None,
    data_parallel: Optional[DeviceMesh] = None,
    experts: Optional[tuple[DeviceMesh, DeviceMesh]] = None,
    blocks: Optional[list[Block]] = None,
    activation_checkpointing: bool = False,
    compile: Union[bool, str] = False,
    compile_mode: Optional[str] = None,
    whole_model: bool = True,
    fsdp: Optional[dict[str, Any]] = None,
) -> Any:
    """Apply steps 0-4 (see the module docstring) to the LitModule `module`, in place; each step only when asked.

    `experts`: (the (efsdp, ep) mesh, a 1-rank mesh) to split an MoE model's experts over (FSDP2 only).
    `blocks`: the blocks this rank holds (a pipeline stage's), else all of `module.blocks()`.
    `compile`: false, true (the largest correct region: `compile_region`) or "blocks"; `compile_mode`: torch.compile's.
    `whole_model`: the caller allows compiling whole networks (see `compile_region`).
    `fsdp`: the options of `shard` (reshard_after_forward, param_dtype, reduce_dtype, cpu_offload).
    """
    blocks = module.blocks() if blocks is None else blocks
    # a frozen parameter (DPO's reference, an adapter's base) stays frozen: tensor parallel's DTensors are new
    # Parameters that require a gradient (an optimizer state then expected for each, and a resume failing on it)
    frozen = {name for name, param in module.named_parameters() if not param.requires_grad}
    split = []
    if experts is not None:
        expert_parallel.check_dispatch(module.network())  # the dispatch computes the model's own experts, or refused
        split = expert_parallel.split_experts(module.network(), *experts)
    if tensor_parallel is not None:
        split_blocks(module, tensor_parallel, [block for _, _, block in blocks])
    if activation_checkpointing:
        checkpoint_blocks(module)
    no_mesh = tensor_parallel is None and data_parallel is None
    region = compile_region(compile, whole_model and no_mesh)
    # in place (Module.compile): the parameter names, and so checkpoints, stay those of the plain model
    parts, heads = compiled_parts(module, region, blocks, head=whole_model and no_mesh)
    for part in parts:
        if region == "model" and getattr(module, "seq_len", None):
            compiled_attention.route(part, module.seq_len)  # SDPA's is_causal for the batches that need no mask
        part.compile(mode=compile_mode)
    for head in heads:  # Module.compile would trace nothing: dynamo skips a frame of torch.nn's own code
        head.forward = torch.compile(head.forward, mode=compile_mode)
    if data_parallel is not None:
        efsdp = (experts[0]["efsdp"], data_parallel.size()) if experts is not None else None
        shard(module, data_parallel, blocks, split, efsdp, **(fsdp or {}))
    for name, param in module.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    module._parallelized = True  # `parallelized`: a strategy's setup runs again for test after fit
    log.info(
        f"parallelize: {len(blocks)} blocks; expert parallel {experts[0]['ep'].size() if experts else 1} "
        f"({len(split)} experts modules), tensor parallel {tensor_parallel.size() if tensor_parallel else 1}, "
        f"activation checkpointing {activation_checkpointing}, compile {region or 'off'}"
        f"{f' ({compile_mode})' if region and compile_mode else ''}, "
        f"FSDP2 over {data_parallel.size() if data_parallel is not None else 0} rank(s)"
    )
    return module


def compile_region(compile: Union[bool, str], whole_model: bool) -> Optional[str]:
    """What model.compile compiles: None, "model" (each network whole: its head and the matmuls between blocks in the
    graph too, where inductor pads a vocabulary such as GPT-2's 50257 to an aligned width) or "blocks" (each block,
    what FSDP2 and tensor parallel's per-block hooks and DTensors, and the pipeline's stages, allow; see
    `compiled_parts`). "auto" is decided from the run before the model is built (src/run/checks.py,
    src/lm/features/compiling.py `auto_compile`); a module made outside a run compiles nothing for it."""
    if compile not in (True, False, "blocks", "auto"):
        raise ConfigError(f"model.compile={compile!r}: use true (the largest correct region), blocks, false or auto.")
    if not compile or compile == "auto":
        return None
    return "model" if compile is True and whole_model else "blocks"


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's


def check_compile_mode(mode: Optional[str], compile: Union[bool, str]) -> None:
    """model.compile_mode: null (torch's default) or one of torch.compile's modes, and only with model.compile on."""
    if mode is not None and mode not in COMPILE_MODES:
        raise ConfigError(
            f"model.compile_mode={mode!r}: use null or one of torch.compile's modes: {', '.join(COMPILE_MODES)}."
        )
    if mode is not None and not compile:
        raise ConfigError(
            f"model.compile_mode={mode} with model.compile=false compiles nothing: set model.compile=true."
        )


def compiled_parts(
    module: Any, region: Optional[str], blocks: list[Block], head: bool
) -> tuple[list[nn.Module], list[nn.Module]]:
    """(the modules, the output projections) `region` compiles: each network whole ("model"), or each block
    ("blocks") and, where `head`
    allows (no mesh, no ZeRO-3), each network's output projection: eagerly, a vocabulary such as GPT-2's 50257 is a
    matmul of an unaligned width (measured on an H200: docs/performance.md).

    Between compiled blocks the model's own forward runs eagerly, its attention masks too; a whole compiled model's
    attention is told which batches need no mask by src/parallel/compiled_attention.py."""
    if region == "model":
        return list(module.networks()), []
    if region != "blocks":
        return [], []
    heads = [getattr(network, "get_output_embeddings", lambda: None)() for network in module.networks() if head]
    return [block for _, _, block in blocks], [h for h in heads if h is not None]


def parallelized(module: Any) -> bool:
    """Whether `parallelize` already ran on the LitModule `module` (each strategy applies it once)."""
    return getattr(module, "_parallelized", False)


def checkpoint_blocks(module: Any) -> None:
    """Recompute each decoder layer's activations in backward: transformers' own switch (non-reentrant
    `torch.utils.checkpoint`; from transformers 5.24 it wraps each layer's `forward`, so module hooks such as
    FSDP2's stay outside the checkpoint and every parameter keeps its name). Only transformers models offer the
    switch here: recomputing a BatchNorm block (the CNN's) would update its running statistics twice."""
    network = module.network()  # a PreTrainedModel, or a peft model that passes the call on to one
    if hasattr(network, "activation_checkpointing_enable"):  # transformers >= 5.24's name
        network.activation_checkpointing_enable()
    elif hasattr(network, "gradient_checkpointing_enable"):
        network.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise ValueError(f"{type(network).__name__} has no activation checkpointing switch.")


def shard(
    module: Any,
    mesh: DeviceMesh,
    blocks: list[Block],
    experts: list[nn.Module],
    efsdp: Optional[tuple[DeviceMesh, int]],
    reshard_after_forward: bool = True,
    param_dtype: Optional[str] = None,
    reduce_dtype: Optional[str] = None,
    cpu_offload: bool = False,
) -> None:
    """FSDP2: shard each block, then every network (embeddings, head, tied weights) as one root unit.

    Each of `module.networks()` must be a root, or its parameters would never be gathered. `experts` (expert
    parallel's split experts modules) are sharded first, over `efsdp` = (their copies' mesh, the data-parallel size):
    their gradients, which already hold their expert group's tokens, are summed over the copies and divided by the
    data-parallel size, as transformers' own expert parallelism does.
    reshard_after_forward=True frees gathered parameters after each block's forward (ZeRO-3-like, least
    memory); False keeps them until backward (ZeRO-2-like, one all-gather less per block).
    """
    for dtype in (param_dtype, reduce_dtype):
        if dtype not in DTYPES:
            raise ValueError(f"FSDP dtype {dtype!r}: use one of {[k for k in DTYPES if k]} or null.")
    if not blocks:  # one unit: every parameter gathered for the whole forward (no saving of memory, still exact)
        log.info(f"FSDP2: {type(module).__name__}.blocks() lists no blocks: each network is sharded as one unit")
    policy = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype]),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    for experts_module in experts:
        fully_shard(experts_module, **{**policy, "mesh": efsdp[0]})
        experts_module.set_gradient_divide_factor(float(efsdp[1]))
        if efsdp[0].size() > 1:  # a divide factor other than the group size is a pre-multiplied sum, which gloo
            experts_module.set_force_sum_reduction_for_comms(True)  # lacks: sum on the wire, divide after
    for _, _, block in blocks:
        fully_shard(block, **policy)
    for network in module.networks():  # the trained network; frozen ones (DPO's reference) are roots of their own
        fully_shard(network, **policy)
