"""Bottleneck adapters (Houlsby et al. 2019; placement=mlp is Pfeiffer et al. 2020's): after a decoder block's
attention and/or MLP, before its residual add, the sublayer's output y becomes y + up(act(down(y))), d -> d/r -> d.
Only the adapters train. `up` starts at zero, so the adapted model starts as the base model; `down` starts at
N(0, 0.01) drawn from a generator keyed by (seed, the adapter's name): the same on every rank and layout.

AdapterHub's `adapters` package pins transformers 4.57 (this template runs 5.x), so the adapters are applied from
outside the model, as the template's other plans are: each one is a child of the sublayer it follows
(`...mlp.bottleneck.down.weight`), called by a forward hook on that sublayer. The model stays its transformers
class, and strategies shard it as before (an adapter lives in its block's FSDP2 unit).

This file needs torch alone: export-hf copies it beside the adapter's weights, so a client with transformers loads
the adapted model without the template (`load`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

ATTENTION = ("self_attn", "attn", "attention", "self_attention")  # Llama, Qwen, Mistral...; GPT-2
MLP = ("mlp", "feed_forward", "block_sparse_moe")  # dense MLPs; Mixtral's experts
ACTIVATIONS = {"relu": torch.nn.ReLU, "gelu": torch.nn.GELU, "silu": torch.nn.SiLU, "tanh": torch.nn.Tanh}
PLACEMENTS = {"attention": ("attention",), "mlp": ("mlp",), "both": ("attention", "mlp")}
FILES = ("bottleneck.json", "bottleneck.safetensors", "bottleneck.py")  # what export-hf writes to OUT/adapter/


@dataclasses.dataclass
class BottleneckConfig:
    """model/peft=bottleneck_adapters: d -> d // reduction_factor -> d after each block's `placement` sublayers."""

    reduction_factor: int = 16
    placement: str = "both"  # attention | mlp | both (Houlsby)
    activation: str = "relu"  # relu | gelu | silu | tanh
    init_std: float = 0.01  # the down-projection's initial weights; up starts at zero
    seed: int = 0  # keys the down-projection's draws (with each adapter's name)

    def __post_init__(self) -> None:
        problems = []
        if self.placement not in PLACEMENTS:
            problems.append(f"placement={self.placement!r} is not one of {', '.join(PLACEMENTS)}")
        if self.activation not in ACTIVATIONS:
            problems.append(f"activation={self.activation!r} is not one of {', '.join(ACTIVATIONS)}")
        if isinstance(self.reduction_factor, bool) or not isinstance(self.reduction_factor, int):
            problems.append(f"reduction_factor={self.reduction_factor!r} is not an integer")
        elif self.reduction_factor < 1:
            problems.append(f"reduction_factor={self.reduction_factor} is below 1")
        if problems:
            raise ValueError(f"model.peft (bottleneck adapters): {'; '.join(problems)}: fix it in model.peft.")

    def export(self, model: torch.nn.Module, out: str | Path) -> Path:
        """`model` (adapted by `add`) as OUT/base/ (save_pretrained of the base alone: a plain model) and
        OUT/adapter/ (`save`): export-hf's call, which cannot import this module (src/checkpoint sits below it)."""
        adapters = state(model)
        base = {k: v for k, v in model.state_dict().items() if k not in adapters}
        model.save_pretrained(Path(out) / "base", state_dict=base)
        return save(model, self, Path(out) / "adapter")


class Bottleneck(torch.nn.Module):
    """h + up(act(down(h))) on the last dimension."""

    def __init__(self, width: int, config: BottleneckConfig) -> None:
        super().__init__()
        inner = max(1, width // config.reduction_factor)
        self.down, self.up = torch.nn.Linear(width, inner), torch.nn.Linear(inner, width)
        self.act = ACTIVATIONS[config.activation]()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(self.act(self.down(h)))


def _after(module: torch.nn.Module, args: Any, output: Any) -> Any:
    """The forward hook: the sublayer's output (an attention's first element) through its adapter."""
    if isinstance(output, tuple):
        return (module.bottleneck(output[0]), *output[1:])
    return module.bottleneck(output)


def sublayers(model: torch.nn.Module, placement: str) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of each decoder block's sublayers that `placement` names, in the model's order."""
    layers = _decoder_layers(model)
    prefix = next(name for name, m in model.named_modules() if m is layers)
    found = []
    for i, block in enumerate(layers):
        children = dict(block.named_children())
        for kind in PLACEMENTS[placement]:
            known = ATTENTION if kind == "attention" else MLP
            names = [n for n in known if n in children]
            if not names:
                raise ValueError(
                    f"{type(block).__name__} has no {kind} sublayer named {' or '.join(known)} (its children: "
                    f"{', '.join(children)}): bottleneck adapters do not know this architecture."
                )
            found.append((f"{prefix}.{i}.{names[0]}", children[names[0]]))
    return found


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's list of decoder blocks (transformers' `layers`, GPT-2's `h`): the first ModuleList whose blocks
    have an attention sublayer."""
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) and any(n in ATTENTION for n, _ in m[0].named_children()):
            return m
    raise ValueError(f"{type(model).__name__} has no decoder blocks with an attention sublayer named {ATTENTION}.")


def add(model: torch.nn.Module, config: BottleneckConfig, train: bool = True) -> torch.nn.Module:
    """`model` with an adapter after each sublayer `config.placement` names; with `train`, only the adapters train.
    The adapters start as the class docstring says (in the model's dtype and device)."""
    width = model.config.hidden_size
    if train:
        for p in model.parameters():
            p.requires_grad_(False)
    param = next(model.parameters())
    for name, sublayer in sublayers(model, config.placement):
        adapter = Bottleneck(width, config).to(device=param.device, dtype=param.dtype)
        with torch.no_grad():
            adapter.up.weight.zero_(), adapter.up.bias.zero_(), adapter.down.bias.zero_()
            digest = hashlib.sha256(f"{config.seed}:{name}.bottleneck.down.weight".encode()).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
            draw = torch.randn(adapter.down.weight.shape, generator=generator, dtype=torch.float32) * config.init_std
            adapter.down.weight.copy_(draw)
        sublayer.bottleneck = adapter
        sublayer.register_forward_hook(_after)
    model.bottleneck_config = config  # as peft's models keep `peft_config`: export-hf finds it there
    return model


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights, by their names in the transformers model."""
    return {name: t.detach() for name, t in model.state_dict().items() if ".bottleneck." in name}


def save(model: torch.nn.Module, config: BottleneckConfig, out: str | Path) -> Path:
    """OUT/bottleneck.json (the config), bottleneck.safetensors (the weights) and this file (the loader)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / FILES[0]).write_text(json.dumps(dataclasses.asdict(config), indent=2) + "\n")
    save_file({k: v.contiguous().clone() for k, v in state(model).items()}, out / FILES[1])
    (out / FILES[2]).write_text(Path(__file__).read_text())
    return out


def load(model: torch.nn.Module, directory: str | Path) -> torch.nn.Module:
    """A transformers model (the base: OUT/base/) with the adapters in `directory` (OUT/adapter/) added, in eval
    use: `sys.path.insert(0, OUT/adapter); import bottleneck; bottleneck.load(model, OUT/adapter)`."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = BottleneckConfig(**json.loads((directory / FILES[0]).read_text()))
    add(model, config, train=False)
    weights = load_file(directory / FILES[1])
    missing = set(state(model)) ^ set(weights)
    if missing:
        raise ValueError(f"{directory} does not match this model's adapters ({sorted(missing)[:3]}...): load its base.")
    model.load_state_dict(weights, strict=False)
    return model
