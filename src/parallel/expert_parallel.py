"""Expert parallelism over the data-parallel ranks (`trainer=fsdp trainer.strategy.expert_parallel_size=k`): each of
a mixture-of-experts model's experts lives on one rank of each group of k, and every token goes to its experts'
ranks and back, as torchtitan and DeepSpeed-MoE do. transformers implements it (`transformers.distributed.
expert_parallel`): this module applies it from outside the model, with the model's own plan, and shards what is left.

* Which modules: the model's `base_model_ep_plan` (transformers ships one for its MoE families): its expert weights
  (`grouped_gemm`) are split by expert over the k ranks, and its experts modules (`ep_dispatch_experts`) send each
  (token, expert) pair to the expert's rank with an all-to-all, run there with routing weight 1, and come back with a
  second all-to-all, weighted and summed on the token's rank (transformers' `AllToAllEP`: the routing weights'
  gradient stays where they were computed). The router is an ordinary, replicated layer: every token is routed as
  one process routes it.
* The meshes: a (W/k, k) mesh of all W ranks; its "ep" dim holds an experts group (neighbouring ranks), its
  "efsdp" dim the W/k copies of each expert, which FSDP2 shards (as the rest is sharded over all W ranks).
* Gradients: an expert's gradient on its rank sums the k ranks' tokens (the all-to-all's backward); FSDP2 sums it
  over the W/k copies and divides by W, as every other gradient is averaged over the W ranks (transformers' own
  recipe: `set_gradient_divide_factor`, and a plain sum on the wire where a copy group has several ranks, since
  gloo has no pre-multiplied sum).
* `check_dispatch` proves, before step 1 and in float64, that the model's experts are what the dispatch assumes:
  their output for a token is the sum over its slots of weight x the expert alone. A model whose experts do more
  (a weight inside a nonlinearity) is refused in one sentence.

What it needs: an MoE model with a `base_model_ep_plan`, an expert count that divides by k, k dividing the world.
"""

from __future__ import annotations

import copy
import fnmatch
from collections import defaultdict
from typing import Any, Iterable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from src.utils.config import ArchitectureRefused, ConfigError, check_int

DISPATCH = "ep_dispatch_experts"  # the plan's style for an experts module (the others are its weights)
FLOAT64_TOL = 1e-9


def ep_plan(config: Any) -> dict[str, str]:
    return dict(getattr(config, "base_model_ep_plan", None) or {})


def num_experts(config: Any) -> Optional[int]:
    for key in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return None


def check_config(config: Any, size: int, world: Optional[int]) -> None:
    """One sentence for what expert_parallel_size=`size` cannot do with this model and world, before any process."""
    check_int("trainer.strategy.expert_parallel_size", size)
    if size == 1:
        return
    kind = getattr(config, "model_type", "this model") if config is not None else "this model"
    if config is None or DISPATCH not in ep_plan(config).values():
        raise ConfigError(
            f"trainer.strategy.expert_parallel_size={size} splits a mixture-of-experts model's experts by the plan "
            f"transformers ships for it (base_model_ep_plan), and {kind} has none: set expert_parallel_size=1."
        )
    experts = num_experts(config)
    if experts is None or experts % size:
        raise ConfigError(
            f"{kind}'s {experts} experts do not divide by trainer.strategy.expert_parallel_size={size}: pick a "
            "divisor of the expert count."
        )
    if world is not None and world % size:
        raise ConfigError(
            f"{world} process(es) do not divide into groups of trainer.strategy.expert_parallel_size={size}: set "
            f"trainer.devices (x trainer.num_nodes) to a multiple of {size}."
        )


def expert_mesh(world: int, size: int, device_type: str) -> DeviceMesh:
    """The (efsdp, ep) mesh of all ranks: an experts group is `size` neighbouring ranks (a collective)."""
    return init_device_mesh(device_type, (world // size, size), mesh_dim_names=("efsdp", "ep"))


def plan_for(network: nn.Module) -> dict[str, str]:
    """The model's ep plan with its wildcards (`layers.*.mlp.experts`) turned into the network's module and
    parameter names, the weights first (an experts module reads its own expert count once they are split)."""
    base = network.base_model
    prefix = next(name for name, module in network.named_modules() if module is base)
    names = [name for name, _ in base.named_modules()] + [name for name, _ in base.named_parameters()]
    plan = {}
    for pattern, style in ep_plan(network.config).items():
        for name in names:
            if fnmatch.fnmatchcase(name, pattern):
                plan[f"{prefix}.{name}" if prefix else name] = style
    return dict(sorted(plan.items(), key=lambda item: item[1] == DISPATCH))


def experts_modules(network: nn.Module) -> list[nn.Module]:
    return [network.get_submodule(name) for name, style in plan_for(network).items() if style == DISPATCH]


@torch.no_grad()
def check_dispatch(network: nn.Module) -> None:
    """Each experts module's output must be the sum over each token's slots of its weight x the module run on that slot
    alone with weight 1 (what the all-to-all dispatch computes); one sentence otherwise. Checked in float64 on a copy of
    the first experts module with 2 random experts (the model may still be on the meta device; one expert of a large
    model is what the copy holds), its experts run one by one (transformers' "eager": grouped kernels take no float64).
    """
    modules = experts_modules(network)
    if not modules:
        raise ArchitectureRefused(
            f"{network.config.model_type}'s expert-parallel plan names no experts module of the built model: "
            "set trainer.strategy.expert_parallel_size=1."
        )
    probe = eager_copy(network, modules[0])
    count = probe.num_experts
    g = torch.Generator().manual_seed(0)
    for name, param in list(probe.named_parameters()):
        shape = (2, *param.shape[1:]) if param.shape and param.shape[0] == count else tuple(param.shape)
        value = torch.randn(shape, generator=g, dtype=torch.float64) / max(1.0, shape[-1] ** 0.5)
        probe.get_submodule(name.rpartition(".")[0]).register_parameter(name.rpartition(".")[2], nn.Parameter(value))
    probe.num_experts = 2
    tokens, hidden = 6, network.config.hidden_size
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    index = torch.stack([torch.randperm(2, generator=g) for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g, dtype=torch.float64)
    whole = probe(x, index, weights)
    ones = torch.ones(tokens, 1, dtype=torch.float64)
    parts = sum(weights[:, j : j + 1] * probe(x, index[:, j : j + 1], ones) for j in range(2))
    gap = (whole - parts).abs().max().item()
    if not gap <= FLOAT64_TOL * max(1.0, whole.abs().max().item()):
        raise ArchitectureRefused(
            f"{network.config.model_type}'s experts are not a weighted sum of single experts (off by {gap:.3g} in "
            "float64), which expert parallelism's dispatch computes: set trainer.strategy.expert_parallel_size=1."
        )


def eager_copy(network: nn.Module, experts: nn.Module) -> nn.Module:
    """A copy of `experts` (on the CPU, its values unset) whose forward runs its experts one by one."""
    implementation = network.get_experts_implementation() if hasattr(network, "get_experts_implementation") else {}
    eager = not any(v not in (None, "eager") for v in implementation.values())
    if not eager:
        network.set_experts_implementation("eager")  # the copy takes a copy of the config that says so
    try:
        probe = copy.deepcopy(experts)
    finally:
        if not eager:
            network.set_experts_implementation(implementation)
    return probe.to_empty(device="cpu")


def split_experts(network: nn.Module, mesh: DeviceMesh, batch_mesh: DeviceMesh) -> list[nn.Module]:
    """Split the experts of `network` over `mesh["ep"]` with transformers' all-to-all dispatch, in place; returns the
    experts modules (each to be sharded over `mesh["efsdp"]`). `batch_mesh`: a 1-rank mesh (each rank its own batch)."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    apply_expert_parallelism(network, mesh["ep"], batch_mesh, plan_for(network), ep_implementation="all_to_all")
    return experts_modules(network)


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for gradients on several meshes: each mesh's norm (its DTensors' shards reduced
    over it), then their root sum of squares, the whole model's norm as one process computes it."""
    grads = [p.grad for p in parameters if p.grad is not None]
    by_mesh: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        by_mesh[grad.device_mesh if isinstance(grad, DTensor) else None].append(grad)
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).double() ** 2)
    total = torch.stack(squares).sum().sqrt().float() if squares else torch.zeros(())
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's own rule
    for grad in grads:
        (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(coef.to(grad.dtype))
    return total
