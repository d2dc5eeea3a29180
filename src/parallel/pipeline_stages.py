"""The pipeline stages of a decoder LM: which modules each stage holds, how it runs them, and the proof, before
step 1, that the stages chained compute the model's own function.

What a stage holds is read from the model: transformers ships `config.base_model_pp_plan` (Llama, Qwen2,
Gemma, Granite, ...): the body's parts in order (embed_tokens -> layers -> norm). The first stage holds the parts
before the layer list and its share of the layers; the last its share and the parts after, plus the LM head.

A `DecoderStage` runs the model's own forward, not a copy of it (as torchtitan's stages do): the body's forward
builds the masks and rotary angles it builds in one process (per layer type, with sliding windows), the layers this
rank does not hold are `Skip`s, a hook hands the received activations to the stage's first layer, and a hook ends
the forward after its last layer. The last stage runs the causal LM's whole forward, so whatever a model does
around its layers (Granite's multipliers and logits scaling, Cohere's logit scale, Gemma's soft-capping, ...)
happens as it does in one process. GPT-2 ships no plan: its hand-written adapter's stage
(src/architectures/gpt2.py) runs it, and is proved equal alike.

`check_stages` proves it for the model at hand: every stage, as its rank will run it (what other stages hold
pruned away), chained in float64 on a probe batch, against the model's own forward; a model whose staged forward
differs, fails, or holds parameters no stage owns is refused in one sentence. That is the guarantee, for any
architecture: no model trains a different function under trainer=pipeline than in one process.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from src.architectures import adapter_for
from src.utils.config import ArchitectureRefused, ConfigError

FLOAT64_TOL = 1e-9  # the staged and the model's own forward run the same operations: in float64 they agree to ~1e-15


def stage_ranges(n_layer: int, n_stages: int) -> list[tuple[int, int]]:
    per = n_layer // n_stages
    return [(i * per, (i + 1) * per) for i in range(n_stages)]


class Skip(nn.Module):
    """Stands in for a decoder layer another stage holds: hands its input on (a stage's hook replaces it)."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


class Reached(Exception):
    """Raised by the hook after a stage's last layer: the stage's output, and the end of the body's forward."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__()
        self.output = output


class DecoderStage(nn.Module):
    """Layers [lo, hi) of a decoder LM whose config has a pipeline plan, run by the model's own forward; the stage
    holds (as its parameters) those layers, the parts the plan puts before them (first stage) or after them plus the
    LM head (last stage)."""

    def __init__(self, hf: nn.Module, lo: int, hi: int, first: bool, last: bool, eager: bool = False) -> None:
        super().__init__()
        body, names = hf.base_model, list(hf.config.base_model_pp_plan)
        split = names.index(layers_name(hf))
        self.first, self.last = first, last
        self.inputs = nn.ModuleDict({n: getattr(body, n) for n in names[:split]}) if first else None
        self.layers = nn.ModuleList(getattr(body, names[split])[lo:hi])
        self.outputs = nn.ModuleDict({n: getattr(body, n) for n in names[split + 1 :]}) if last else None
        self.lm_head = hf.get_output_embeddings() if last else None
        self.model = (hf,)  # a tuple: the whole model is not this stage's submodule (its parameters are not ours)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hf = self.model[0]
        hooks = []
        if not self.first:  # the activations received replace what reaches the first layer we hold
            hooks.append(self.layers[0].register_forward_pre_hook(feed(x), with_kwargs=True))
        if not self.last:
            hooks.append(self.layers[-1].register_forward_hook(reached))
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}  # a middle stage's are shape and dtype
        try:
            if self.last:
                return hf(**inputs, use_cache=False).logits
            hf.base_model(**inputs, use_cache=False)
        except Reached as end:
            return end.output
        finally:
            for hook in hooks:
                hook.remove()
        raise RuntimeError(f"{hf.config.model_type}'s forward never reached this stage's last layer")

    def input_embedding(self) -> Optional[nn.Module]:
        return next(iter(self.inputs.values())) if self.first else None

    def output_embedding(self) -> Optional[nn.Module]:
        return self.lm_head


def feed(x: torch.Tensor) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    return hook


def reached(module: nn.Module, args: tuple, output) -> None:
    raise Reached(output if isinstance(output, torch.Tensor) else output[0])


def layers_name(hf: nn.Module) -> str:
    """The name of the body's decoder-layer list in the pipeline plan ("layers")."""
    plan = getattr(hf.config, "base_model_pp_plan", None) or {}
    lists = [name for name in plan if isinstance(getattr(hf.base_model, name, None), nn.ModuleList)]
    if len(lists) != 1:
        raise ArchitectureRefused(
            f"{hf.config.model_type}'s pipeline plan {list(plan)} does not name one layer list: "
            "train it with trainer=fsdp or trainer=ddp."
        )
    return lists[0]


def stage_class(config) -> type[nn.Module]:
    """DecoderStage for models with transformers' pipeline plan, a hand-written adapter's stage (GPT-2's); one
    sentence otherwise."""
    if getattr(config, "base_model_pp_plan", None):
        return DecoderStage
    adapter = adapter_for(config.model_type)
    if adapter is not None and adapter.stage is not None:
        return adapter.stage
    raise ConfigError(
        f"trainer=pipeline needs a pipeline plan and {config.model_type}'s config has none "
        "(base_model_pp_plan): GPT-2, Llama, Qwen2, Mistral and the other models transformers ships a "
        "plan for work; train this one with trainer=fsdp or trainer=ddp."
    )


def pruning(hf: nn.Module, layers: nn.ModuleList, keep: set[int], first: bool, last: bool) -> list[tuple]:
    """What a rank holding layers `keep` (and the first and/or last stage) drops: (parent, name, stand-in) for each
    layer it does not hold (a Skip), each part before or after the layers that holds parameters (None) and the LM
    head. The parts without parameters (dropout, rotary angles) stay: the body's forward calls them on every stage."""
    drops = [(layers, str(i), Skip()) for i in range(len(layers)) if i not in keep]
    body = hf.base_model
    if getattr(hf.config, "base_model_pp_plan", None):
        names = list(hf.config.base_model_pp_plan)
        split = names.index(layers_name(hf))
        before, after = names[:split], names[split + 1 :]
    else:  # GPT-2
        before, after = ["wte", "wpe"], ["ln_f"]
    for name in (before if not first else []) + (after if not last else []):
        part = getattr(body, name, None)
        if isinstance(part, nn.Module) and any(True for _ in part.parameters()):
            drops.append((body, name, None))
    if not last:
        drops.append((hf, "lm_head", None))
    return drops


def prune(hf: nn.Module, layers: nn.ModuleList, keep: set[int], first: bool, last: bool) -> None:
    """Drop what this rank does not hold; the kept modules keep their names (model.model.layers.3..., or GPT-2's
    model.transformer.h.3...), so checkpoint shards merge under the plain HF names."""
    for parent, name, stand_in in pruning(hf, layers, keep, first, last):
        setattr(parent, name, stand_in)


@contextlib.contextmanager
def pruned(hf: nn.Module, layers: nn.ModuleList, keep: set[int], first: bool, last: bool) -> Iterator[None]:
    """`prune`, undone on exit: the probe runs each stage as its rank will."""
    drops = pruning(hf, layers, keep, first, last)
    saved = [(parent, name, getattr(parent, name)) for parent, name, _ in drops]
    try:
        prune(hf, layers, keep, first, last)
        yield
    finally:
        for parent, name, module in saved:
            setattr(parent, name, module)


@contextlib.contextmanager
def in_float64(model: nn.Module) -> Iterator[None]:
    """The model in float64 and eval mode; every tensor's dtype and every module's mode restored on exit (the round
    trip fp32/bf16 -> float64 -> back is exact). Mixture-of-experts layers run their experts one by one ("eager"):
    the grouped kernel transformers picks takes no float64; the probe compares how stages compose, not kernels."""
    dtypes = {name: t.dtype for name, t in [*model.named_parameters(), *model.named_buffers()]}
    modes = {m: m.training for m in model.modules()}
    experts = model.get_experts_implementation() if hasattr(model, "get_experts_implementation") else {}
    if any(v not in (None, "eager") for v in experts.values()):
        model.set_experts_implementation("eager")
    model.double().eval()
    try:
        yield
    finally:
        if any(v not in (None, "eager") for v in experts.values()):
            model.set_experts_implementation(experts)
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            t.data = t.data.to(dtypes[name])
        for m, mode in modes.items():
            m.training = mode


def check_stages(hf: nn.Module, layers: nn.ModuleList, n_stages: int, make: type[nn.Module], eager: bool) -> None:
    """Before anything is pruned: the `n_stages` stages chained, each as its rank will run it, equal the model's own
    forward in float64 on a probe batch, and own every parameter between them; one sentence otherwise."""
    config, n_layer = hf.config, len(layers)
    kind = config.model_type
    refuse = "train it with trainer=fsdp, trainer=tp or trainer=ddp"
    ranges = stage_ranges(n_layer, n_stages)
    stages = [make(hf, lo, hi, first=i == 0, last=i == n_stages - 1, eager=eager) for i, (lo, hi) in enumerate(ranges)]
    owned = {id(p) for stage in stages for p in stage.parameters()}
    orphans = [name for name, p in hf.named_parameters() if id(p) not in owned]
    if orphans:
        raise ArchitectureRefused(
            f"trainer=pipeline cannot split {kind}: its parameters {orphans[:3]} are in no part its pipeline plan "
            f"names, so no stage would train them; {refuse}."
        )
    t = min(64, getattr(config, "max_position_embeddings", None) or 64)
    device = next(hf.parameters()).device
    ids = torch.randint(0, config.vocab_size, (2, t), generator=torch.Generator().manual_seed(0)).to(device)
    with in_float64(hf), torch.no_grad():
        expected = hf(input_ids=ids, use_cache=False).logits
        x = ids
        try:
            for i, (stage, (lo, hi)) in enumerate(zip(stages, ranges)):
                with pruned(hf, layers, set(range(lo, hi)), first=i == 0, last=i == n_stages - 1):
                    x = stage(x)
        except Exception as error:  # noqa: BLE001 - any failure of the staged forward is a refusal, said
            first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
            raise ArchitectureRefused(
                f"trainer=pipeline cannot split {kind}: running its stages failed ({type(error).__name__}: "
                f"{first_line}); {refuse}."
            ) from None
    gap = (x - expected).abs().max().item() if x.shape == expected.shape else float("inf")
    if not gap <= FLOAT64_TOL * max(1.0, expected.abs().max().item()):
        raise ArchitectureRefused(
            f"trainer=pipeline would train a different function than one process for {kind}: its stages' logits "
            f"differ from the model's own forward by {gap:.3g} at most (float64, probe batch); {refuse}."
        )
