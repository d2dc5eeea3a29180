"""Dropout whose masks do not depend on the layout: each row's mask is a function of the run's seed, the optimizer
step, the row's sample (its index in the dataset) and the module, never of the rank, the micro-batch or the RNG state.

torch's dropout draws from the device's generator, so the same sample gets another mask on 1 process than on rank 1
of 2, or in another micro-batch: a run with dropout trains another model on every layout. Here every `nn.Dropout` of
the trained model is replaced by `KeyedDropout` (`key_dropouts`), which hashes (row key, module, element position)
with a 32-bit integer finaliser and keeps the elements whose hash is at least p x 2^32: plain tensor ops, on any
device and under torch.compile, or (`use_kernel`, the run's `compile_dropout`: `wants_kernel`) one kernel per tensor
compiled by inductor, with the same values. A row's key (`row_keys`) mixes the seed, the step and its sample index; an
element's position is its index along each dimension, so a row right-padded to another width keeps its mask. Whoever
runs the training forward sets the keys before it (`set_keys`); a training forward without keys is an error, not a
silent draw from torch's generator.

Dropout a model draws with `torch.nn.functional.dropout` is keyed the same way, salted by the module and the call's
number within its forward: attention dropout goes through `keyed_attention` (transformers' attention function
registry: the model's own eager attention function where a training forward drops, the implementation it was built
with otherwise), and a module whose own forward calls it (Seed-OSS's and StarCoder2's residual dropout) runs that
forward under `_KeyedFunctionalDropout`, entered by forward hooks. A user's module is keyed whole by `key_module`;
a config's dropout probabilities are set by `set_probability` (model.dropout).
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import zlib
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers import PretrainedConfig

from src.utils.config import ConfigError, check_number

_M32 = 0xFFFFFFFF
# (the keys of the current training forward's rows, int64 in [0, 2^32)); a module global rather than an attribute of
# each module, so that torch.compile reads it as a graph input instead of guarding on each step's new tensor
_rows: list[Optional[torch.Tensor]] = [None]


def _mix(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 values in [0, 2^32): an avalanche of every input bit into every output
    bit. Products may pass 2^63; their low 32 bits, all that is kept, are the same either way."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def row_keys(sample_index: torch.Tensor, rows: int, step: int, seed: int) -> torch.Tensor:
    """The key of each of `rows` rows made from the batch's `sample_index` (one per sample): a batch of k rows a
    sample holds k blocks of the samples, in order (a pair batch: the chosen rows, then the rejected), and row
    j x B + i gets the key of (sample i, block j)."""
    n = sample_index.numel()
    if n == 0 or rows % n:
        raise ValueError(f"{rows} rows cannot be keyed by {n} sample indices")
    block = torch.arange(rows // n, device=sample_index.device).repeat_interleave(n)
    samples = sample_index.to(torch.int64).repeat(rows // n)
    h = _mix(torch.full_like(samples, (seed ^ 0x5BD1E995) & _M32))
    h = _mix(h ^ (step & _M32))
    h = _mix(h ^ (samples & _M32))
    h = _mix(h ^ ((samples >> 32) & _M32))
    return _mix(h ^ block)


def set_keys(keys: Optional[torch.Tensor]) -> None:
    """The row keys of the step's forward, kept until the next: an activation-checkpointing recompute in the backward
    draws the same masks as the forward did."""
    _rows[0] = keys


def keyed_mask(shape: torch.Size, keys: torch.Tensor, salt: int, p: float) -> torch.Tensor:
    """Keep (True) or drop for each element of a tensor of `shape` whose dim 0 holds the keyed rows."""
    return _hash(shape, keys, salt) >= int(p * 2**32)


def _hash(shape: torch.Size, keys: torch.Tensor, salt: int) -> torch.Tensor:
    """Each element's hash in [0, 2^32): its row's key and salt, then its index along each dimension."""
    h = _mix(keys.view(-1, *([1] * (len(shape) - 1))) ^ salt)
    for dim in range(1, len(shape)):
        index = torch.arange(shape[dim], device=keys.device).view(*([1] * dim), -1, *([1] * (len(shape) - dim - 1)))
        h = _mix(h ^ index)
    return h


class KeyedDropout(nn.Module):
    """nn.Dropout with keyed masks (module doc): the same `p` (read by transformers, e.g. GPT-2's SDPA path)."""

    def __init__(self, p: float, name: str) -> None:
        super().__init__()
        self.p, self.name = p, name
        self.salt = zlib.crc32(name.encode())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return _keyed(x, self.p, self.salt, self.name)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def key_dropouts(model: nn.Module) -> int:
    """Replace every nn.Dropout of `model` by a KeyedDropout of the same p named by its place in `model`; the number
    replaced with p > 0. Run on the model as trained (adapters added), so the names are those of every layout."""
    n = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Dropout:
                full = f"{name}.{child_name}" if name else child_name
                setattr(module, child_name, KeyedDropout(child.p, full))
                n += child.p > 0
    return n


class _KeyedFunctionalDropout(TorchFunctionMode):
    """While a module's forward (or its eager attention function) runs: each `torch.nn.functional.dropout` it calls
    itself, keyed like KeyedDropout's by the rows, the module's salt and the call's number in that forward (the
    forward's k-th call draws the same mask on every layout, and again in an activation-checkpointing recompute)."""

    def __init__(self, salt: int, name: str) -> None:
        super().__init__()
        self.salt, self.name, self.calls = salt, name, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is nn.functional.dropout:
            x, p = args[0], kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            self.calls += 1
            if training and p > 0:
                return _keyed(x, p, (self.salt + 0x9E3779B1 * self.calls) & _M32, f"{self.name} ({self.calls})")
            return x
        return func(*args, **kwargs)


def _enter(module: nn.Module, args: Any) -> None:
    if module.training:
        module.keyed_mode = _KeyedFunctionalDropout(module.keyed_salt, module.keyed_name)
        module.keyed_mode.__enter__()


def _leave(module: nn.Module, args: Any, output: Any) -> None:
    mode = module.__dict__.pop("keyed_mode", None)
    if mode is not None:
        mode.__exit__(None, None, None)


def calls_functional_dropout(module: nn.Module) -> bool:
    """Whether `module`'s class's own forward calls torch.nn.functional.dropout (Seed-OSS's and StarCoder2's
    residual dropout), read from its source."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return re.search(r"\b(?:nn\.functional|F)\.dropout\(", source) is not None


def key_functional_dropouts(model: nn.Module) -> int:
    """Each module of `model` whose own forward calls functional dropout runs it keyed (_KeyedFunctionalDropout,
    entered and left by forward hooks); the number of such modules. nn.Dropout modules are KeyedDropout instead."""
    n = 0
    for name, module in model.named_modules():
        if isinstance(module, (nn.Dropout, KeyedDropout)) or "keyed_functional" in module.__dict__:
            continue  # (keyed already: a second setup of the same module)
        if not calls_functional_dropout(module):
            continue
        module.keyed_functional = True
        module.keyed_salt, module.keyed_name = zlib.crc32(name.encode()), name
        module.register_forward_pre_hook(_enter)
        module.register_forward_hook(_leave, always_call=True)
        n += 1
    return n


def _keyed(x: torch.Tensor, p: float, salt: int, name: str) -> torch.Tensor:
    keys = _rows[0]
    if keys is None:
        raise RuntimeError(
            f"{name}: a training forward with dropout needs its rows' keys (src/core/dropout.py set_keys)"
        )
    if keys.shape[0] != x.shape[0]:
        raise ConfigError(
            f"{name}: dropout keyed by sample needs the batch's samples on dim 0 of its input, which has "
            f"{x.shape[0]} rows for {keys.shape[0]} samples: put the batch first in that tensor, or set its p to 0."
        )
    if p == 1:
        return torch.zeros_like(x)
    if _kernel[0] and not torch.compiler.is_compiling():  # (a compiled network fuses the eager expression itself)
        return _KeyedKernel.apply(x, keys ^ salt, p)
    return _masked(x, keys ^ salt, p)


def _masked(x: torch.Tensor, salted: torch.Tensor, p: float) -> torch.Tensor:
    """x times its keyed mask (the row keys already salted by the module) and 1 / (1 - p)."""
    return x * keyed_mask(x.shape, salted, 0, p).to(x.dtype) * (1 / (1 - p))


# whether _keyed runs its mask as one compiled kernel (use_kernel)
_kernel: list[bool] = [False]


def _kernel_masked(x: torch.Tensor, salted: torch.Tensor, threshold: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """_masked's values with p as two 0-d tensors (the threshold p x 2^32 and 1 / (1 - p), in float64), x times the
    scale in x's opmath type (float32, or float64 for float64), as eager `x * (1 / (1 - p))` computes. (Passed as a
    Python float, p became a graph input whose int(p x 2^32) inductor's cache kept from the first p for every other,
    pytorch/pytorch#197889: tests/test_dropout.py.)"""
    h = _hash(x.shape, salted, 0)
    opmath = torch.float64 if x.dtype == torch.float64 else torch.float32
    return ((x * (h >= threshold).to(x.dtype)).to(opmath) * scale.to(opmath)).to(x.dtype)


@functools.cache
def _compiled_masked() -> Callable:
    return torch.compile(_kernel_masked, dynamic=True)  # sizes dynamic: a new sequence length does not recompile


@functools.cache
def _constants(p: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's p, once per probability and device (no copy to the GPU each call)."""
    threshold = torch.tensor(int(p * 2**32), dtype=torch.int64, device=device)
    return threshold, torch.tensor(1 / (1 - p), dtype=torch.float64, device=device)


class _KeyedKernel(torch.autograd.Function):
    """_masked as one fused kernel forward and one backward (the gradient is the output's times the same mask, drawn
    again from the keys): inductor's loop on a CPU, a Triton kernel on a GPU. The backward keeps the row keys, not
    the mask (eagerly autograd keeps the mask in the input's dtype)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, salted: torch.Tensor, p: float) -> torch.Tensor:
        ctx.save_for_backward(salted)
        ctx.p = p
        # x detached and contiguous, as the backward's gradient: one graph for both
        return _compiled_masked()(x.detach().contiguous(), salted, *_constants(p, x.device))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (salted,) = ctx.saved_tensors
        return _compiled_masked()(grad.contiguous(), salted, *_constants(ctx.p, grad.device)), None, None


def use_kernel(compiled: bool) -> None:
    """Keyed dropout from here on as one compiled kernel per tensor (True) or eager tensor ops (False): the same
    masks and values either way (tests/test_dropout.py)."""
    _kernel[0] = compiled


def wants_kernel(setting: Any, device: torch.device) -> bool:
    """compile_dropout (conf/train.yaml): true, false, or auto = the kernel on a GPU, eager tensor ops elsewhere. On a
    2-core Xeon the kernel takes 0.3x torch's dropout and the eager ops 0.9-1.4x, but inductor compiles each tensor rank
    (hidden states, attention weights) in 15-20 s the first time on a machine (docs/performance.md): a short CPU run
    would spend more on compiling than it saves."""
    if setting not in (True, False, "auto"):
        raise ConfigError(f"compile_dropout={setting!r}: use true, false or auto.")
    return device.type == "cuda" if setting == "auto" else bool(setting)


def keyed_attention(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0, **kwargs):
    """transformers' attention function for a model with attention dropout (`key_attention`): without dropout
    (evaluation, or p = 0) the implementation the model was built with; with dropout the model's own eager attention
    function, its dropout keyed per row and attention module."""
    if dropout == 0:
        return module.keyed_inner_attention(module, query, key, value, attention_mask, dropout=0.0, **kwargs)
    if module.keyed_eager_attention is None:
        raise ConfigError(
            f"{type(module).__name__} has attention dropout and its file no eager_attention_forward to key it with: "
            "set model.dropout=0."
        )
    causal = kwargs.get("is_causal")  # as sdpa_attention_forward reads it: the call's, else the module's, else True
    mask = _additive(attention_mask, query, key, getattr(module, "is_causal", True) if causal is None else causal)
    # salted apart from the module's own forward's calls (Seed-OSS's attention also drops its output itself)
    with _KeyedFunctionalDropout(module.keyed_salt ^ 0x5A175A17, f"{module.keyed_name} attention"):
        return module.keyed_eager_attention(module, query, key, value, mask, dropout=dropout, **kwargs)


def _additive(
    mask: Optional[torch.Tensor], query: torch.Tensor, key: torch.Tensor, causal: bool
) -> Optional[torch.Tensor]:
    """The mask an eager attention function adds to its scores: sdpa's boolean one (True: attend) as 0 / the dtype's
    minimum, or, where sdpa would have used `is_causal` (no mask, a `causal` module), the causal one; None where an
    encoder's batch has no padding (no mask, not causal: every position attends to every other)."""
    if mask is None and not causal:
        return None
    if mask is None:
        q, k = query.shape[-2], key.shape[-2]
        mask = torch.ones(q, k, dtype=torch.bool, device=query.device).tril(k - q)[None, None]
    if mask.dtype == torch.bool:
        blocked = torch.finfo(query.dtype).min
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, blocked)
    return mask


def key_attention(model: nn.Module, implementation: str) -> bool:
    """Route `model`'s attention (built with `implementation`) through keyed_attention, registered with transformers
    as "keyed_sdpa" or "keyed_eager" with that implementation's masks (evaluation computes what it computed). Each
    module gets the functions and the salt keyed_attention reads; False (nothing changed) for another implementation
    than sdpa or eager (FlashAttention and flex draw their dropout inside their kernels)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation not in ("sdpa", "eager"):
        return False
    ALL_ATTENTION_FUNCTIONS.register(f"keyed_{implementation}", keyed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(f"keyed_{implementation}", ALL_MASK_ATTENTION_FUNCTIONS[implementation])
    for name, module in model.named_modules():
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        module.keyed_eager_attention = eager
        module.keyed_inner_attention = sdpa_attention_forward if implementation == "sdpa" else eager
        module.keyed_salt, module.keyed_name = zlib.crc32(name.encode()), name
    model.set_attn_implementation(f"keyed_{implementation}")
    return True


def key_module(module: nn.Module) -> int:
    """Every dropout of a user's module keyed per sample, as the language model's are: its nn.Dropout modules, the
    attention dropout of each transformers model inside it whose config holds a dropout probability (BERT's, RoBERTa's,
    ViT's...), and the functional dropout its modules' own forwards call (a forward that calls F.dropout). The number
    keyed (modules with p > 0, attention, functional); one sentence for attention that draws its dropout inside a
    kernel no key reaches (FlashAttention, flex)."""
    n = key_dropouts(module)
    for name, model in _transformers_models(module):
        fields = {k: v for k, v in config_fields(model.config, PROBABILITY_FIELD).items() if v}
        if not fields or getattr(sys.modules[type(model).__module__], "eager_attention_forward", None) is None:
            continue  # no dropout, or attention of its own (DeBERTa's nn.Dropout on the probabilities: keyed above)
        implementation = model.config._attn_implementation  # private: tests/test_private_names.py
        if implementation.startswith("keyed_"):
            continue  # keyed already (a second setup of the same module)
        if not key_attention(model, implementation):
            raise ConfigError(
                f"{name or 'the module'} ({type(model).__name__}) has dropout ({field_list(fields)}) and attention "
                f"{implementation!r}, which draws its attention dropout inside its kernel from each rank's generator: "
                "build it with attn_implementation='sdpa' or 'eager' (keyed per sample), or set its attention dropout to 0."
            )
        n += 1
    return n + key_functional_dropouts(module)


def _transformers_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost transformers models (PreTrainedModel) inside `module`, with their names."""
    from transformers import PreTrainedModel

    found: list[tuple[str, nn.Module]] = []
    for name, child in module.named_modules():
        inside = any(outer == "" or name.startswith(f"{outer}.") for outer, _ in found)
        if isinstance(child, PreTrainedModel) and not inside:
            found.append((name, child))
    return found


def has_dropout(model: nn.Module) -> bool:
    """Whether `model` holds a dropout module with p > 0 (keyed or not)."""
    return any(isinstance(m, (nn.Dropout, KeyedDropout)) and m.p > 0 for m in model.modules())


PROBABILITY_FIELD = re.compile(r"dropout|pdrop", re.IGNORECASE)  # what model.dropout sets
RANDOM_FIELD = re.compile(r"dropout|pdrop|jitter|noise", re.IGNORECASE)  # what a training forward may draw from


def config_fields(config: Any, pattern: re.Pattern = RANDOM_FIELD, prefix: str = "") -> dict[str, float]:
    """The numeric fields of a transformers config (and of its sub-configs, as `text_config.x`) whose names match
    `pattern`, with their values."""
    found = {}
    for name, value in vars(config).items():
        if isinstance(value, PretrainedConfig):
            found.update(config_fields(value, pattern, f"{prefix}{name}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and pattern.search(name):
            found[prefix + name] = value
    return found


def set_probabilities(config: Any, p: float) -> None:
    """Every dropout probability of `config` (PROBABILITY_FIELD, sub-configs too) set to p, before a model is built
    from it: transformers' modules read them when they are made."""
    for name in config_fields(config, PROBABILITY_FIELD):
        *parents, field = name.split(".")
        target = config
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, field, p)


# ---- a model's dropout probability (model.dropout) ----


def check_probability(p: Optional[float]) -> Optional[float]:
    """model.dropout: null (the architecture's own probabilities) or a probability in [0, 1)."""
    if p is not None:
        check_number("model.dropout", p, lambda v: 0 <= v < 1, "a probability in [0, 1), or null")
    return p


def set_probability(built: Any, p: Optional[float]) -> Any:
    """model.dropout (when set) in a config, before its model is built, or in a built model's dropout modules: every
    dropout probability of the architecture (an adapter's has its own option)."""
    if p is not None:
        if isinstance(built, PretrainedConfig):
            set_probabilities(built, p)
        for module in built.modules() if isinstance(built, nn.Module) else ():
            if isinstance(module, nn.Dropout):
                module.p = p
    return built


def field_list(fields: dict[str, float]) -> str:
    named = [f"{k}={v}" for k, v in fields.items()]
    return ", ".join(named) if named else "its dropout modules"
