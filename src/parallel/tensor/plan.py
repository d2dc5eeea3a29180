"""Megatron-style tensor parallelism for decoder layers, applied from outside the model (torchtitan's style).

Each layer's attention and MLP are split over the `tensor_parallel` ranks with torch's DTensor
`ColwiseParallel` / `RowwiseParallel`: the q, k, v and MLP input projections by output columns (each rank
computes its own heads and its own share of the MLP), the attention output and MLP output projections by
input rows, followed by one all-reduce each. So per layer: 2 all-reduces of the activations in forward, 2
in backward.

Which projection is split which way is read from the model: transformers ships it as
`config.base_model_tp_plan` (Llama, Qwen2, Mistral and most modern decoders: `layers.*.self_attn.q_proj:
colwise`, ...). Their attention infers its head count from the projection's width, so each rank's local
heads (and key/value heads, under grouped-query attention) need nothing more. The plan's styles, as torch's:

    colwise                          ColwiseParallel(): output sharded (this rank's heads / MLP share)
    rowwise                          RowwiseParallel(): input sharded, output all-reduced
    colwise_gather_output            ColwiseParallel(output_layouts=Replicate()): output gathered whole (Phi-3's
                                     fused qkv_proj and gate_up_proj: the gathered output is the packed one)
    rowwise_split_input              RowwiseParallel(input_layouts=Replicate()): a whole input, each rank its slice
    replicated_with_grad_allreduce   SequenceParallel(sequence_dim=-2): a per-head norm (Qwen3's, Gemma3's q_norm
                                     and k_norm) holds one weight for every head and sees this rank's heads: its
                                     input is marked sharded over the heads dim, so the weight's gradient is the
                                     sum over all ranks' heads (DTensor keeps it Partial until the optimizer
                                     reduces it), never one rank's heads alone.

transformers implements the same styles (`transformers.distributed.tensor_parallel`), for its own loading path:
its replicated_with_grad_allreduce keeps a plain parameter and all-reduces its gradient in a post-accumulate
hook, which FSDP2 (step 4 of src/parallel/parallelize.py, over the data-parallel ranks) loses when it
replaces the parameters, and which sums an already accumulated gradient again under gradient accumulation; and
torch's fused AdamW and clipping need every parameter a DTensor (`replicate_the_rest`). So the styles map to
torch's, which need neither. An experts module (moe_tp_experts, with its weights' packed_colwise / rowwise) is
split by experts instead (src/parallel/tensor/experts.py says why). Other styles (MLA's mla_kv_a_proj, local_params,
all_reduce, embedding_rowwise, ...) are refused in one sentence naming them.

GPT-2 has no plan: its hand-written adapter (src/architectures/gpt2_adapter.py) gives one, and turns its Conv1D layers
into the nn.Linear that torch's styles split (`own_adapter`); its checkpoints keep that layout and say so
(`layout`). Models with a plan keep transformers' own layout: their full state dict is already HF's.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from src.architectures import adapter_for
from src.architectures.config import head_counts
from src.architectures.handwritten import Adapter
from src.parallel.tensor import experts
from src.utils.config import ArchitectureRefused, ConfigError

log = logging.getLogger(__name__)


# the plan styles trainer=tp implements (with torch's DTensor styles, see the module docstring)
STYLES = (
    *("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "replicated_with_grad_allreduce"),
    *("packed_colwise", "packed_rowwise", "moe_tp_experts"),  # experts: src/parallel/tensor/experts.py
)


def own_adapter(config: Any) -> Optional[Adapter]:
    """The hand-written adapter that splits this model (GPT-2's), None where transformers' plan does."""
    return None if getattr(config, "base_model_tp_plan", None) else adapter_for(config.model_type)


def layout(config: Any, tp: int) -> Optional[dict[str, Any]]:
    """The checkpoint's LAYOUT_KEY entry when its weights are in a hand-written adapter's layout; None for HF's own."""
    adapter = own_adapter(config)
    return adapter.tp_layout(config, tp) if adapter is not None else None


def layer_plan(config: Any) -> Optional[dict[str, str]]:
    """How one decoder layer splits ({"self_attn.q_proj": "colwise", ...}): transformers' plan for the model
    (`base_model_tp_plan`, keys "layers.*.<path>"), GPT-2's own, or None when the model has neither."""

    shipped = getattr(config, "base_model_tp_plan", None) or {}
    plan = {pattern.partition(".*.")[2]: style for pattern, style in shipped.items() if ".*." in pattern}
    if not plan:
        adapter = own_adapter(config)
        return dict(adapter.tp_plan) if adapter is not None else None
    unknown = sorted({style for style in plan.values() if style not in STYLES})
    if unknown:
        raise ConfigError(
            f"{config.model_type}'s tensor-parallel plan uses the style(s) {unknown}, which trainer=tp "
            f"does not implement ({', '.join(STYLES)}): train it with trainer=fsdp or trainer=ddp."
        )
    return plan


def check_plan(config: Any) -> dict[str, str]:

    plan = layer_plan(config)
    if plan is None:
        raise ConfigError(
            f"trainer=tp needs a tensor-parallel plan and {config.model_type}'s config has none "
            "(base_model_tp_plan): GPT-2, Llama, Qwen2, Mistral and the other models transformers "
            "ships a plan for work; train this one with trainer=fsdp or trainer=ddp."
        )
    return plan


def torch_style(style: str) -> Any:
    """torch's DTensor style for one of the plan's (STYLES; the module docstring says why each)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=-2, use_local_output=True),
    }[style]()


def split_blocks(module: Any, mesh: DeviceMesh, blocks: list[nn.Module]) -> Any:
    """Split `blocks` of `module` (src/parallel/contract.py's ParallelLM; all of them, or the ones a pipeline stage
    holds) over the 1-D `mesh` (the tensor-parallel ranks); every other parameter becomes a replicated DTensor. Step 1
    of src/parallel/parallelize.py."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = mesh.size()
    config = module.hf_model.config
    check_divisible(config, tp)
    plan = check_plan(config)
    adapter = own_adapter(config)
    if adapter is not None:
        adapter.prepare_tensor_parallel(blocks, config, tp)
    kinds = {tuple(type(m) for m in b.modules()): b for b in blocks}  # each kind of layer: dense, MoE, hybrid
    for block in kinds.values():
        check_whole_inside(block, plan, config.model_type)
    for block in blocks:  # weights the plan names (the experts') go with their experts module, not to torch's styles
        modules = {n: s for n, s in plan.items() if s not in experts.OWN_STYLES and not _is_param(block, n)}
        parallelize_module(block, mesh, {name: torch_style(style) for name, style in modules.items()})
        for path, style in experts_styles(block, plan, config.model_type, tp).items():
            style._apply(block.get_submodule(path), mesh)
    for network in module.networks():
        replicate_the_rest(network, mesh)
    heads, kv_heads, _ = head_counts(config)
    log.info(
        f"Tensor parallel: {len(blocks)} blocks split over {tp} ranks ({heads // tp} query and {kv_heads // tp} "
        f"key/value heads per rank)"
    )
    return module


def experts_styles(block: nn.Module, plan: dict[str, str], model_type: str, tp: int) -> dict[str, Any]:
    """The block's experts modules (moe_tp_experts) and their ExpertsParallel (src/parallel/tensor/experts.py: the
    experts split over the ranks, the plan's own split of their weights replaced). One sentence when that cannot
    be exact: an expert count that does not divide, an experts module that is not transformers' kind (a
    `num_experts` and every weight one row per expert), a weight the plan splits outside an experts module."""
    found: dict[str, Any] = {}
    for path in (p for p, style in plan.items() if style == experts.MODULE_STYLE):
        try:
            module = block.get_submodule(path)
        except AttributeError:  # a dense layer of a model that mixes dense and MoE layers
            continue
        count = getattr(module, "num_experts", None)
        odd = [n for n, p in module.named_parameters() if p.shape[0] != count]
        if not isinstance(count, int) or odd:
            raise ArchitectureRefused(
                f"trainer=tp cannot split {model_type}'s experts ({path}): {odd[:3]} is not one row per expert "
                f"(num_experts={count}); train it with trainer=fsdp or trainer=ddp."
            )
        if count % tp:
            raise ArchitectureRefused(
                f"trainer=tp splits {model_type}'s {count} experts over the tensor-parallel ranks and {count} does "
                f"not divide by trainer.strategy.tensor_parallel_size={tp}: pick a size that divides it."
            )
        found[path] = experts.ExpertsParallel()
    for name, style in plan.items():
        owner = name.rpartition(".")[0]
        inside = plan.get(owner) == experts.MODULE_STYLE
        if not inside and (style.startswith("packed") or (style in experts.PARAM_STYLES and _is_param(block, name))):
            raise ArchitectureRefused(
                f"trainer=tp cannot split {model_type}: its tensor-parallel plan splits the weight {name} ({style}) "
                f"outside an experts module, which trainer=tp does not implement; train it with trainer=fsdp or "
                "trainer=ddp."
            )
    return found


def _resolves(block: nn.Module, name: str) -> bool:
    """Whether the plan's entry `name` names a module or parameter of `block` (a model's dense and MoE layers
    share one plan; each holds only its own entries)."""
    try:
        block.get_submodule(name)
    except AttributeError:
        return _is_param(block, name)
    return True


def _is_param(block: nn.Module, name: str) -> bool:
    try:
        block.get_parameter(name)
    except AttributeError:
        return False
    return True


def check_whole_inside(block: nn.Module, plan: dict[str, str], model_type: str) -> None:
    """One sentence when the plan leaves a parameter whole that sees one rank's share of the activations: one held by
    a module that sits beside a colwise and a rowwise layer of the plan (between them, where each rank holds its
    heads or its share of the MLP) and is not in the plan itself. Apertus' xIELU activation (two scalars in the MLP)
    and OLMo-Hybrid's linear-attention convolution are such: each rank would update them from its own share's
    gradient, a different model (or a crash) that the plan does not say how to avoid."""
    present = {name: style for name, style in plan.items() if _resolves(block, name)}  # this kind of layer's
    children: dict[str, set[str]] = {}
    for name, style in present.items():
        parent, _, _ = name.rpartition(".")
        children.setdefault(parent, set()).add(style)
    whole = []
    for parent in (p for p, styles in children.items() if {"colwise", "rowwise"} <= styles):
        owner, depth = (block.get_submodule(parent), len(parent.split("."))) if parent else (block, 0)
        for name, _ in owner.named_parameters():
            parts = f"{parent}.{name}".lstrip(".").split(".")
            # covered: the parameter, or a module below `parent` that holds it, is in the plan
            if not any(".".join(parts[:i]) in present for i in range(len(parts), depth, -1)):
                whole.append(".".join(parts))
    if whole:
        raise ArchitectureRefused(
            f"trainer=tp cannot split {model_type} exactly: its tensor-parallel plan leaves {whole[:3]} whole "
            "between layers it splits, where each rank sees its own share of the activations; train it with "
            "trainer=fsdp or trainer=ddp."
        )


def check_forward(module: Any) -> None:
    """One forward of a short probe batch once the model is split and on its device (every rank runs it: the split
    forward holds collectives). A model whose split forward fails, e.g. a module that uses a weight outside its own
    forward (OLMo-Hybrid's and Qwen3.5's linear-attention convolution) and so meets a replicated DTensor with a
    plain tensor, is one sentence here, not a traceback at step 1."""
    ids = torch.zeros(1, 8, dtype=torch.long, device=module.device)
    modes = {m: m.training for m in module.modules()}
    try:
        with torch.no_grad():
            module.eval()(ids)
    except Exception as error:  # noqa: BLE001 - any failure of the split forward is a refusal, said
        first = (str(error).strip().splitlines() or [""])[0][:200]
        raise ArchitectureRefused(
            f"trainer=tp cannot split {module.hf_model.config.model_type}: its forward fails once split "
            f"({type(error).__name__}: {first}); train it with trainer=fsdp or trainer=ddp."
        ) from None
    finally:
        for m, mode in modes.items():
            m.training = mode


def replicate_the_rest(network: nn.Module, mesh: DeviceMesh) -> None:
    """Every other parameter (embeddings, LayerNorms, the tied head) as a DTensor replicated on `mesh`.

    torch's fused AdamW and clip_grad_norm_ refuse a mix of DTensors and plain tensors; with all of them
    DTensors, clip_grad_norm_ reduces each sharded gradient's norm over the ranks (the whole model's norm).
    Each such module takes its inputs as replicated DTensors and hands plain tensors on; parameters shared between modules
    (GPT-2 ties wte and lm_head) stay one parameter.
    """
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def to_dtensor(_module, inputs, device_mesh):
        return tuple(
            DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            if torch.is_tensor(x) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    def to_local(_module, output, _mesh):  # a router's (logits, weights, indices) too
        if isinstance(output, tuple):
            return tuple(x.to_local() if isinstance(x, DTensor) else x for x in output)
        return output.to_local() if isinstance(output, DTensor) else output

    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in network.modules():
        for name, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod, name))
    todo = [
        (mod, [(name, p) for name, p in mod.named_parameters(recurse=False) if not isinstance(p, DTensor)])
        for mod in network.modules()
    ]
    for mod, plain in todo:
        if not plain:
            continue
        distribute_module(mod, mesh, input_fn=to_dtensor, output_fn=to_local)
        for name, old in plain:  # give every other owner of a shared parameter the same new one
            for other, other_name in owners[id(old)]:
                if other is not mod:
                    setattr(other, other_name, getattr(mod, name))


def check_divisible(config: Any, tp: int) -> None:
    """Every rank gets whole heads (query and key/value) and an equal share of the MLP."""

    heads, kv_heads, _ = head_counts(config)
    key = "trainer.strategy.tensor_parallel_size"
    adapter = own_adapter(config)
    if adapter is not None:
        return adapter.check_divisible(config, tp)
    width = getattr(config, "intermediate_size", None) or 0  # per layer in some configs (Gemma-3n)
    if heads % tp or kv_heads % tp or any(w % tp for w in (width if isinstance(width, list) else [width])):
        raise ConfigError(
            f"model.config.num_attention_heads={heads}, num_key_value_heads={kv_heads} and "
            f"intermediate_size={width} must all divide by {key}={tp}: pick a tensor-parallel size "
            "that divides them."
        )
    experts_count = next((getattr(config, k) for k in EXPERT_COUNTS if isinstance(getattr(config, k, None), int)), 0)
    if experts.MODULE_STYLE in (getattr(config, "base_model_tp_plan", None) or {}).values() and experts_count % tp:
        raise ConfigError(
            f"trainer=tp splits the experts over the tensor-parallel ranks and {config.model_type}'s "
            f"{experts_count} experts do not divide by {key}={tp}: pick a tensor-parallel size that divides them."
        )


EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")  # the configs' names for it
