"""Mixture-of-experts layers under tensor parallelism: each rank of the group holds its share of the experts.

transformers' plans name the experts of Mixtral, Qwen-MoE, OLMoE, DeepSeek and ~55 other architectures so:

    layers.*.mlp.experts.gate_up_proj   packed_colwise   [experts, 2 x width, hidden]
    layers.*.mlp.experts.down_proj      rowwise          [experts, hidden, width]
    layers.*.mlp.experts                moe_tp_experts   the module: partial outputs, summed over the ranks

transformers splits each expert's width there: rank r holds gate rows r and up rows r of the packed weight, a
strided split that torch's distributed checkpoint cannot store (it writes one contiguous block per rank and
refuses the two as "overlapping chunks"), which is how trainer=tp saves. So here the group splits the experts
instead (expert parallelism over the tensor ranks): rank r holds experts [r E/T, (r+1) E/T) whole, every weight
of the experts module split on its first dim (a contiguous block: checkpoints, resharding and FSDP2 over the
data-parallel ranks work as for any other weight). The function is the one of one process:

* the router is replicated: every rank routes every token the same way, as one process does;
* each rank runs its own experts on the tokens routed to them: a token's slots that chose another rank's expert
  get the index the experts' forward skips (`num_experts`, transformers' own expert-parallel sentinel, with
  its private `_is_expert_parallel` switch on, as transformers' expert parallelism sets it) and weight 0;
* the partial outputs are summed over the group (one all-reduce in forward); in backward the input's gradient
  and the routing weights' are summed the same way (each rank's experts gave a part of each).

What it needs: the expert count divides by the tensor-parallel size (one sentence otherwise). What it gives: each
rank holds and computes 1/T of the experts; the load per rank follows the routing (the router's balance loss,
src/lm/objectives/moe.py, is what keeps it even), where transformers' width split is even by construction.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

MODULE_STYLE = "moe_tp_experts"
PARAM_STYLES = ("colwise", "rowwise", "packed_colwise", "packed_rowwise")  # the plan's names for expert weights
OWN_STYLES = (MODULE_STYLE, "packed_colwise", "packed_rowwise")  # styles only experts modules hold (here)


class _SumGrad(torch.autograd.Function):
    """Identity in forward; in backward, the gradient summed over the group (each rank's experts gave a part)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOutput(torch.autograd.Function):
    """The partial outputs summed over the group in forward; identity in backward (the sum's gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _plain(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value  # the router's outputs: replicated DTensors


class ExpertsParallel(ParallelStyle):
    """moe_tp_experts as expert parallelism over the tensor ranks (the module docstring says why and how). The
    experts module's forward is called (hidden_states, top_k_index, top_k_weights), as transformers' experts are."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_tensor

        count, size, rank = module.num_experts, device_mesh.size(), device_mesh.get_local_rank()
        local = count // size
        for name, param in list(module.named_parameters(recurse=False)):
            owned = nn.Parameter(distribute_tensor(param.data, device_mesh, [Shard(0)]), param.requires_grad)
            module.register_parameter(name, owned)
        module.num_experts = local  # the forward's expert count and skip index: this rank's experts
        if hasattr(module, "_is_expert_parallel"):  # transformers' grouped kernels zero the skipped slots' rows only
            module._is_expert_parallel = True  # then (as its own expert parallelism sets it; a canary test checks)
        group, held = device_mesh.get_group(), {}

        def before(mod, args, kwargs):
            hidden, index, weights = (_plain(a) for a in args)
            for name, param in mod.named_parameters(recurse=False):  # the forward indexes plain tensors
                held[name] = param
                mod._parameters[name] = param.to_local()
            if hidden.requires_grad:
                hidden = _SumGrad.apply(hidden, group)
            if weights.requires_grad:  # before the mask: the sum gathers each slot's gradient from its rank
                weights = _SumGrad.apply(weights, group)
            index = index - rank * local
            mine = (index >= 0) & (index < local)
            index = torch.where(mine, index, local)  # another rank's expert: the slot the forward skips
            return (hidden, index, weights * mine), kwargs

        def after(mod, args, kwargs, output):
            mod._parameters.update(held)
            return _SumOutput.apply(output, group)

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after, with_kwargs=True)
        return module
