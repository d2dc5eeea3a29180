"""Parameter initialisation that does not depend on how the model is laid out, so a model too big for
one rank can be built on the meta device and materialised shard by shard.

Every parameter is drawn from its own generator, seeded from (a base seed, the parameter's name): the
values are the same whether the whole model is materialised in one process (`materialize_full`), or
each rank of FSDP2 makes its own shard (`materialize_sharded`, which generates one full parameter at a
time and keeps its slice: the peak is one parameter, never the model), or DeepSpeed ZeRO-3 fills each
partitioned parameter on rank 0 (`materialize_zero3`). HF's own init cannot do this: it draws from the
global RNG module by module, so its values depend on which modules exist on the rank.

The base seed is one draw from the global RNG (seeded by `seed`), taken when the module is built.
"""

from __future__ import annotations

import contextlib
import hashlib
from contextvars import ContextVar
from typing import Callable, Iterator, Optional

import torch
from torch import nn
from transformers import PreTrainedModel

# fill(name, tensor, generator): writes the initial values of the parameter `name` into `tensor` (CPU, fp32)
Fill = Callable[[str, torch.Tensor, torch.Generator], None]

_DEFERRED: ContextVar[bool] = ContextVar("deferred_init", default=False)
_WRAPPERS = ("._checkpoint_wrapped_module", "._orig_mod")  # activation checkpointing / compile insert these


@contextlib.contextmanager
def deferred_init(enabled: bool = True) -> Iterator[None]:
    """Models built inside stay on the meta device; the strategy materialises them (train.py)."""
    token = _DEFERRED.set(bool(enabled))
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def init_is_deferred() -> bool:
    """Inside deferred_init, or built under `with torch.device("meta")` (shapes only: leave it so)."""
    return _DEFERRED.get() or torch.get_default_device().type == "meta"


def draw_base_seed() -> int:
    """One draw from the global RNG: after seed_everything(seed), the same on every rank."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64, device="cpu").item())


def canonical_name(name: str) -> str:
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def full_value(fill: Fill, base_seed: int, name: str, shape: torch.Size) -> torch.Tensor:
    """The parameter's whole initial value (fp32, CPU), the same wherever and whenever it is made."""
    digest = hashlib.sha256(f"{base_seed}:{canonical_name(name)}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    value = torch.empty(shape, dtype=torch.float32, device="cpu")  # the CPU generator, whatever the default device
    fill(canonical_name(name), value, generator)
    return value


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


@torch.no_grad()
def allocate(model: nn.Module, device: torch.device, tie: bool = True) -> None:
    """Memory for `model` (on meta) on `device`, its buffers kept or recomputed; parameters hold garbage until filled.

    `to_empty` gives buffers memory but not values, persistent or not. Buffers the model was built with
    (hf.build_on_meta builds them on the CPU, as an eager build does) get their values back. For a model built
    wholly on meta (`with torch.device("meta")`), transformers' own per-module init recomputes them (RoPE's
    inv_freq, Gemma's embed_scale beside its embedding's weight: functions of the config; not every buffer: Apertus'
    xIELU sets its own in __init__, which is why hf.build_on_meta keeps them). That init runs on every module that
    holds a buffer, with every parameter marked initialised (`_is_hf_initialized`,
    which transformers' init functions skip), under a forked RNG: no parameter is drawn or changed there, and the
    global RNG moves as if it had not run. Private names, each with a canary: `_init_weights`
    (tests/test_architectures.py), `_is_hf_initialized` (tests/test_meta_init.py).
    """
    built = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}  # hf.build_on_meta's
    model.to_empty(device=device)
    if tie and hasattr(model, "tie_weights"):
        model.tie_weights()  # to_empty gives each module its own new tensor
    for name, buffer in model.named_buffers():
        if name in built:
            buffer.copy_(built[name])
    owners = init_owners(model)
    if not any(owners.values()) or len(built) == len(dict(model.named_buffers())):
        return
    unmarked = [p for p in model.parameters() if not getattr(p, "_is_hf_initialized", False)]
    for param in unmarked:
        param._is_hf_initialized = True
    try:
        with torch.random.fork_rng(devices=[]):
            for module, owner in owners.items():
                if owner is not None and next(module.buffers(recurse=False), None) is not None:
                    owner._init_weights(module)
    finally:
        for param in unmarked:
            del param._is_hf_initialized


def init_owners(model: nn.Module) -> dict[nn.Module, Optional[nn.Module]]:
    """Each module -> the transformers model whose `_init_weights` initialises it: the nearest one holding it, or
    itself, as transformers' own init dispatches (a sub-model's init may read its own attributes: Gemma-3n's text
    model's `hidden_size`); None outside any."""
    owners: dict[nn.Module, Optional[nn.Module]] = {}

    def walk(module: nn.Module, owner: Optional[nn.Module]) -> None:
        owner = module if isinstance(module, PreTrainedModel) else owner
        owners[module] = owner
        for child in module.children():
            walk(child, owner)

    walk(model, None)
    return owners


@torch.no_grad()
def materialize_full(model: nn.Module, fill: Fill, base_seed: int, device: torch.device) -> None:
    """Allocate `model` (on meta) on `device` and fill every parameter. Tied weights stay tied."""
    allocate(model, device)
    for name, param in model.named_parameters():
        param.copy_(full_value(fill, base_seed, name, param.shape))


@torch.no_grad()
def materialize_sharded(model: nn.Module, fill: Fill, base_seed: int, device: torch.device) -> None:
    """`model` after fully_shard, still on meta: allocate each rank's shards and fill them with the slice
    of the full value `materialize_full` would give. One full parameter at a time exists on a rank."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    allocate(model, device, tie=False)
    for name, param in model.named_parameters():
        value = full_value(fill, base_seed, name, param.shape)
        if isinstance(param, DTensor):  # src_data_rank=None: every rank slices its own copy, no communication
            value = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(value)
        else:
            param.copy_(value)
        del value


@torch.no_grad()
def materialize_zero3(model: nn.Module, fill: Fill, base_seed: int, state_dict: Optional[dict] = None) -> None:
    """`model` built inside deepspeed.zero.Init (each parameter already partitioned): gather one parameter
    at a time, let rank 0 write its value (from `state_dict` if given), and re-partition."""
    import deepspeed
    import torch.distributed as dist

    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if dist.get_rank() == 0:
                value = state_dict[name] if state_dict is not None else full_value(fill, base_seed, name, param.shape)
                param.copy_(value)


@torch.no_grad()
def load_full_state_sharded(model: nn.Module, state_dict: Optional[dict], device: torch.device) -> None:
    """`model` after fully_shard, on meta: allocate the shards and fill them from rank 0's full
    `state_dict` (None on the other ranks), which is broadcast one tensor at a time."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    allocate(model, device, tie=False)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, state_dict or {}, options=options)


def local_param_bytes(module: nn.Module) -> int:
    """Bytes of parameter storage this rank holds (a DTensor's local shard; meta tensors hold none)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for param in module.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        if not local.is_meta:
            total += local.numel() * local.element_size()
    return total


def frozen(model: nn.Module) -> nn.Module:
    """`model` in evaluation mode with every parameter frozen (a reference policy)."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
