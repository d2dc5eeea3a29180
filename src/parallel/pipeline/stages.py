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
(src/architectures/gpt2_adapter.py) runs it, and is proved equal alike.

A mixture-of-experts model whose router loss is trained carries each sequence's routing totals from stage to stage
(`Routing`), beside the activations, and its last stage also returns them for the loss. transformers' load-balancing
loss (each MoE model's `load_balancing_loss_func`, taken per sequence by src/lm/objectives/moe.py) adds, layer by layer,
each expert's routed real tokens and its router probabilities, and takes the loss from the two totals: so each stage
adds its layers' to the totals it received (`stage_statistics`, in transformers' order and dtype), the last takes
each sequence's loss from them (`statistics_balance`), and the probabilities' gradient flows back through the stages.

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
from torch.distributed.tensor import DTensor

from src.architectures import adapter_for
from src.utils.config import ArchitectureRefused, ConfigError

FLOAT64_TOL = 1e-9  # the staged and the model's own forward run the same operations: in float64 they agree to ~1e-15
ROUTER_TOL = 1e-6  # the router loss's sums are float32 (as transformers'): an ulp of a probability is ~6e-8


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


def stage_statistics(
    router_logits: list[torch.Tensor], mask: torch.Tensor, hits: torch.Tensor, probs: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`hits` [batch, experts] (each sequence's real tokens routed to e, over its top-k) and `probs` [batch, experts]
    (its router probabilities of e), float32, with these MoE layers' added in order, as transformers adds each layer
    (`mask` [batch, seq]: 1 for a real token). `router_logits`: one [batch x seq, experts] tensor per layer."""
    batch, num_experts = hits.shape
    weight = mask.float()[:, :, None]
    for layer in router_logits:
        if isinstance(layer, DTensor):  # a tensor-parallel router's: its whole value (replicated: no communication)
            layer = layer.full_tensor()
        p = torch.softmax(layer.reshape(batch, -1, num_experts), dim=-1)  # in the logits' dtype, as transformers
        picked = torch.topk(p, top_k, dim=-1).indices
        hits = hits + (torch.nn.functional.one_hot(picked, num_experts).sum(2) * weight).sum(1)
        probs = probs + (p.float() * weight).sum(1)
    return hits, probs


def statistics_balance(hits: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor, n_layers: int) -> torch.Tensor:
    """Each sequence's load-balancing loss [batch] from its totals over all `n_layers` MoE layers (`stage_statistics`):
    the experts' token shares times their mean probabilities, summed, times the expert count, as transformers'."""
    rows = mask.float().sum(1, keepdim=True) * n_layers  # what transformers averages over: real tokens x layers
    return hits.shape[1] * ((hits / rows) * (probs / rows)).sum(1)


class Routing:
    """An MoE model's router loss through the stages: the first stage takes (input_ids, mask), every stage hands on
    (activations, mask, hits, probs), the routing totals (`stage_statistics`) with its layers' added; the last
    stage returns (logits, mask, hits, probs), from which `balance` is each sequence's load-balancing loss.

    The routers are found on the model, before it is split: the modules whose output (or the part of it) is one of
    the router logits the model's own forward returns with output_router_logits=True. A stage records their outputs
    with forward hooks, so its forward asks transformers for nothing (its own batch-level loss is not computed)."""

    def __init__(self, hf: nn.Module, fn: Callable) -> None:
        self.fn = fn  # the model's own load_balancing_loss_func: what check_stages compares with
        self.num_experts, self.top_k = hf.num_experts, hf.num_experts_per_tok
        outputs: dict[nn.Module, tuple] = {}

        def spy(module: nn.Module, args: tuple, output) -> None:  # returns None: the output stays as it is
            outputs[module] = output if isinstance(output, tuple) else (output,)

        hooks = [module.register_forward_hook(spy) for module in hf.modules()]
        probe = torch.zeros(1, 2, dtype=torch.long, device=next(hf.parameters()).device)
        try:
            with torch.no_grad():
                logits = hf(input_ids=probe, use_cache=False, output_router_logits=True).router_logits
        finally:
            for hook in hooks:
                hook.remove()
        self.n_layers = len(logits)  # the MoE layers of the whole model: what the loss averages over
        wanted = {id(t) for t in logits}
        found = {m: i for m, out in outputs.items() for i, t in enumerate(out) if id(t) in wanted}
        inner = {m for m in found if not any(c in found for c in m.modules() if c is not m)}  # not a router's parent
        self.routers = {m: found[m] for m in inner}  # module -> the index of the router logits in its output

    def record(self, modules: nn.Module, into: list) -> list:
        """Hooks on the routers among `modules`' submodules, appending their router logits to `into` as they run."""

        def record(module: nn.Module, args: tuple, output) -> None:
            into.append(output[self.routers[module]] if isinstance(output, tuple) else output)

        return [m.register_forward_hook(record) for m in modules.modules() if m in self.routers]

    def add(self, router_logits: list[torch.Tensor], mask: torch.Tensor, *totals: torch.Tensor) -> tuple:
        if not totals:  # the first stage: nothing routed yet
            zeros = torch.zeros(mask.shape[0], self.num_experts, dtype=torch.float32, device=mask.device)
            totals = (zeros, zeros)
        return (mask, *stage_statistics(router_logits, mask, *totals, self.top_k))

    def balance(self, mask: torch.Tensor, hits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        return statistics_balance(hits, probs, mask, self.n_layers)


class DecoderStage(nn.Module):
    """Layers [lo, hi) of a decoder LM whose config has a pipeline plan, run by the model's own forward; the stage
    holds (as its parameters) those layers, the parts the plan puts before them (first stage) or after them plus the
    LM head (last stage). With `routing`, it carries the router loss's totals too."""

    def __init__(
        self,
        hf: nn.Module,
        lo: int,
        hi: int,
        first: bool,
        last: bool,
        eager: bool = False,
        routing: Optional[Routing] = None,
    ) -> None:
        super().__init__()
        self.routing = routing
        body, names = hf.base_model, list(hf.config.base_model_pp_plan)
        split = names.index(layers_name(hf))
        self.first, self.last = first, last
        self.inputs = nn.ModuleDict({n: getattr(body, n) for n in names[:split]}) if first else None
        self.layers = nn.ModuleList(getattr(body, names[split])[lo:hi])
        self.outputs = nn.ModuleDict({n: getattr(body, n) for n in names[split + 1 :]}) if last else None
        self.lm_head = hf.get_output_embeddings() if last else None
        self.model = (hf,)  # a tuple: the whole model is not this stage's submodule (its parameters are not ours)

    def forward(self, x: torch.Tensor, *carried: torch.Tensor):
        hf = self.model[0]
        routed: list[torch.Tensor] = []  # this stage's layers' router logits, in the order they run
        hooks = self.routing.record(self.layers, routed) if self.routing is not None else []
        if not self.first:  # the activations received replace what reaches the first layer we hold
            hooks.append(self.layers[0].register_forward_pre_hook(feed(x), with_kwargs=True))
        if not self.last:
            hooks.append(self.layers[-1].register_forward_hook(reached))
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}  # a middle stage's are shape and dtype
        try:
            if self.last:
                out = hf(**inputs, use_cache=False).logits
            else:
                hf.base_model(**inputs, use_cache=False)
                raise RuntimeError(f"{hf.config.model_type}'s forward never reached this stage's last layer")
        except Reached as end:
            out = end.output
        finally:
            for hook in hooks:
                hook.remove()
        return out if self.routing is None else (out, *self.routing.add(routed, *carried))

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


REFUSE = "train it with trainer=fsdp, trainer=tp or trainer=ddp"


def check_owned(hf: nn.Module, stages: list[nn.Module]) -> None:
    """Every parameter of the model is some stage's, or one sentence."""
    owned = {id(p) for stage in stages for p in stage.parameters()}
    orphans = [name for name, p in hf.named_parameters() if id(p) not in owned]
    if orphans:
        raise ArchitectureRefused(
            f"trainer=pipeline cannot split {hf.config.model_type}: its parameters {orphans[:3]} are in no part its "
            f"pipeline plan names, so no stage would train them; {REFUSE}."
        )


def chained(hf: nn.Module, layers: nn.ModuleList, stages: list[nn.Module], ranges, x, carried: tuple) -> tuple:
    """(the last stage's output, what it carries) of the stages run one after another on `x`, each with the model
    pruned to what its rank will hold; a failure is one sentence."""
    routed = bool(carried)  # an MoE model's routing totals ride along after the hidden states
    try:
        for i, (stage, (lo, hi)) in enumerate(zip(stages, ranges)):
            with pruned(hf, layers, set(range(lo, hi)), first=i == 0, last=i == len(stages) - 1):
                out = stage(x, *carried)
            x, carried = (out[0], out[1:]) if routed else (out, ())
    except Exception as error:  # noqa: BLE001 - any failure of the staged forward is a refusal, said
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise ArchitectureRefused(
            f"trainer=pipeline cannot split {hf.config.model_type}: running its stages failed "
            f"({type(error).__name__}: {first_line}); {REFUSE}."
        ) from None
    return x, carried


def check_stages(
    hf: nn.Module,
    layers: nn.ModuleList,
    n_stages: int,
    make: type[nn.Module],
    eager: bool,
    routing: Optional[Routing] = None,
) -> None:
    """Before anything is pruned: the `n_stages` stages chained, each as its rank will run it, equal the model's own
    forward in float64 on a probe batch, and own every parameter between them; with `routing`, each sequence's
    router loss from the carried totals equals the model's own function on it (a padded row included). One sentence
    otherwise."""
    config, kind, ranges = hf.config, hf.config.model_type, stage_ranges(len(layers), n_stages)
    build = {"routing": routing} if routing is not None else {}
    stages = [
        make(hf, lo, hi, first=i == 0, last=i == n_stages - 1, eager=eager, **build)
        for i, (lo, hi) in enumerate(ranges)
    ]
    check_owned(hf, stages)
    t = min(64, getattr(config, "max_position_embeddings", None) or 64)
    device = next(hf.parameters()).device
    ids = torch.randint(0, config.vocab_size, (2, t), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[1, t - t // 4 :] = 0  # a right-padded row: the stages see no mask, the router loss masks it
    with in_float64(hf), torch.no_grad():
        expected = hf(input_ids=ids, use_cache=False).logits
        x, carried = chained(hf, layers, stages, ranges, ids, (mask,) if routing is not None else ())
        if routing is not None:
            own = hf(input_ids=ids, attention_mask=mask, use_cache=False, output_router_logits=True).router_logits
            want = torch.stack(  # the model's own function on each sequence alone, its padding masked
                [routing.fn(tuple(layer[b * t : (b + 1) * t] for layer in own), routing.num_experts,
                            routing.top_k, mask[b : b + 1]) for b in range(2)]
            )  # fmt: skip
            got = routing.balance(*carried)
    gap = (x - expected).abs().max().item() if x.shape == expected.shape else float("inf")
    if not gap <= FLOAT64_TOL * max(1.0, expected.abs().max().item()):
        raise ArchitectureRefused(
            f"trainer=pipeline would train a different function than one process for {kind}: its stages' logits "
            f"differ from the model's own forward by {gap:.3g} at most (float64, probe batch); {REFUSE}."
        )
    if routing is not None:
        # the totals are float32 sums, as transformers' own: the same sums in the same order, to an ulp or so
        off = (got - want).abs().max().item()
        if not off <= ROUTER_TOL * max(1.0, want.abs().max().item()):
            raise ArchitectureRefused(
                f"trainer=pipeline would train {kind}'s router load-balancing loss differently from one process: "
                f"carried through its stages it is {off:.3g} away from the model's own (probe batch); {REFUSE}, "
                "or set model.router_aux_loss=false."
            )
