"""Resume any checkpoint on another number of ranks or under another strategy, exactly where it stopped.

Which path a checkpoint takes depends on the form it was written in and the form the strategy reads:

* the same family, any N: the strategy's own loader. A file holds full tensors (DDP, one device); a DCP dir
  (FSDP2, tensor parallel, pipeline) is resharded by torch's DCP load, each rank reading the slices it now owns;
* any other pair (a DCP dir into DDP or one device; a file into FSDP2, tensor parallel or a pipeline; one
  DCP family into another, e.g. GPT-2's tensor-parallel layout into FSDP2): through the *full form*. The
  source is read whole on CPU (`read_full`), with the model's tensors in the model's own layout and the
  optimizer state keyed by parameter names, and the live target takes it with torch's
  `set_model_state_dict` / `set_optimizer_state_dict`, which shard it as the target needs.
  Each rank holds the full form in CPU memory while it loads (weights + Adam's two moments: 12 bytes a
  parameter in fp32), so a model too large for one host resumes only within its family.
* DeepSpeed's ZeRO dirs resume only under DeepSpeed (`check_resume`).

More than Lightning's loaders: Lightning reads a full file into FSDP2 by numbering the optimizer's parameters
in `named_parameters()` order, which is wrong as soon as the optimizer has two parameter groups (ours: decay
and no decay), and reads a DCP dir into nothing but the strategy that wrote it. So every checkpoint also stores
its optimizer's parameter names (NAMES_KEY) and its data position (src/callbacks/resume_anywhere.py).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.distributed.tensor import DTensor

from src.architectures import adapter_for
from src.checkpoint import safe_load
from src.checkpoint.files import AtomicCheckpointIO
from src.utils.config import ConfigError

log = logging.getLogger(__name__)

NAMES_KEY = "optimizer_param_names"  # per optimizer, per param group: the parameters' names, in the group's order
WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")  # not part of a parameter's name
METADATA = "meta.pt"  # Lightning's name for the non-tensor part of a DCP checkpoint
# checkpoint entry: {"model_type", "size", ...} when the weights are in a hand-written adapter's tensor-parallel
# layout (GPT-2's: src/architectures/gpt2_adapter.py), absent when in the model's own
LAYOUT_KEY = "tensor_parallel"


def to_hf(state_dict: dict, entry: dict) -> dict:
    """A full state dict in the layout `entry` names -> the model's own (transformers') layout."""
    entry = dict(entry)
    return adapter_for(entry.pop("model_type", "gpt2")).to_hf(state_dict, **entry)  # older entries: GPT-2's


def from_hf(state_dict: dict, entry: dict) -> dict:
    """`to_hf`'s inverse."""
    entry = dict(entry)
    return adapter_for(entry.pop("model_type", "gpt2")).from_hf(state_dict, **entry)


# ---- forms ----


def form_of(path: str | Path) -> str:
    """ "file", "deepspeed", "dcp" (FSDP2 / tensor parallel: nested optimizer state) or "dcp_flat" (the pipeline's
    flattened optimizer state: `optimizer_0.param_groups.<name>.lr`). A dir is checked to hold nothing but what the
    template writes (src/checkpoint/safe_load.py) before any library reads it: every resume asks its form first."""
    path = Path(path)
    if path.is_file():
        return "file"
    safe_load.check_dir(path)
    if (path / "latest").is_file():
        return "deepspeed"
    keys = safe_load.dcp_metadata(path).state_dict_metadata
    flat = any(k.startswith("optimizer_") and not k.split(".")[2].isdigit() for k in keys if ".param_groups." in k)
    return "dcp_flat" if flat else "dcp"


def stored_layout(path: str | Path) -> Optional[dict]:
    """A DCP dir's tensor-parallel layout entry (LAYOUT_KEY), None when in the model's own."""
    meta = Path(path) / METADATA
    if not meta.is_file():
        return None
    return safe_load.load(meta, map_location="cpu").get(LAYOUT_KEY)


def zero_ranks(path: Path) -> int:
    """The data-parallel ranks a DeepSpeed ZeRO dir was written by: one optimizer-state file each."""
    tag = (path / "latest").read_text().strip()
    return len(list((path / tag).glob("*zero_pp_rank_*_optim_states.pt")))


def check_resume(path: str | Path, deepspeed: bool, world: Optional[int] = None) -> None:
    """One sentence, before any rank starts, for the pairs no loader can join: DeepSpeed's ZeRO dirs and the rest
    (`world`: the ranks this run will have, None when only known at launch)."""
    path = Path(path)
    form = form_of(path)
    if form == "deepspeed" and deepspeed:
        written = zero_ranks(path)
        if world is not None and written and written != world:
            raise ConfigError(
                f"ckpt_path={path} is a DeepSpeed ZeRO checkpoint of {written} ranks and this run has {world}: "
                f"DeepSpeed repartitions no optimizer state, so resume it on {written} ranks, or continue on "
                f"{world} from its weights with model.pretrained={path} (a fresh optimizer)."
            )
        return
    if (form == "deepspeed") == deepspeed:
        return
    if form == "deepspeed":
        raise ConfigError(
            f"ckpt_path={path} is a DeepSpeed ZeRO checkpoint, which resumes only under trainer=deepspeed on the "
            "same number of ranks; to continue under another strategy start from its weights: "
            f"model.pretrained={path} (a fresh optimizer)."
        )
    raise ConfigError(
        f"ckpt_path={path} was not written by DeepSpeed, and trainer=deepspeed resumes only its own ZeRO dirs: "
        "resume it with trainer=ddp, fsdp, tp or pipeline (any of them reads it), or start DeepSpeed from its "
        f"weights with model.pretrained={path}."
    )


# ---- the full form: whole tensors, the model's own layout, the optimizer keyed by parameter names ----


def clean(name: str) -> str:
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def param_names(module: torch.nn.Module, optimizer: Any) -> list[list[str]]:
    """The names of `optimizer`'s parameters, group by group, as `module` (the LightningModule) calls them."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper: its public torch optimizer
    names = {id(p): clean(n) for n, p in module.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def is_named(state: dict) -> bool:
    """Whether an optimizer state dict is keyed by parameter names (torch.distributed.checkpoint's form), not numbers."""
    return all(isinstance(p, str) for g in state.get("param_groups", []) for p in g["params"])


def named_from_numbered(state: dict, names: list[list[str]]) -> dict:
    """torch's `Optimizer.state_dict()` (parameters numbered) -> the same keyed by parameter names."""
    groups = state["param_groups"]
    if [len(g["params"]) for g in groups] != [len(n) for n in names]:
        raise ConfigError("The checkpoint's optimizer groups do not match the parameter names it stores.")
    name_of = {i: name for g, group_names in zip(groups, names) for i, name in zip(g["params"], group_names)}
    return {
        "state": {name_of[i]: value for i, value in state["state"].items()},
        "param_groups": [{**g, "params": list(n)} for g, n in zip(groups, names)],
    }


def named_from_flat(flat: dict) -> dict:
    """The pipeline's flattened form (`state.<name>.exp_avg`, `param_groups.<name>.lr`) -> the nested named form;
    parameters with the same hyperparameters form one group, in order of first appearance."""
    state: dict[str, dict] = {}
    hyper: dict[str, dict] = {}
    for key, value in flat.items():
        kind, rest = key.split(".", 1)
        name, field = rest.rsplit(".", 1)
        (state if kind == "state" else hyper).setdefault(name, {})[field] = value
    groups: dict[str, dict] = {}
    for name, hp in hyper.items():
        groups.setdefault(repr(sorted(hp.items())), {**hp, "params": []})["params"].append(name)
    return {"state": state, "param_groups": list(groups.values())}


def relayout(ckpt: dict, convert: Callable[[dict], dict]) -> None:
    """Apply a weight-layout conversion to the model's tensors and to each optimizer's per-parameter tensors."""
    ckpt["state_dict"] = convert(ckpt["state_dict"])
    for optimizer in ckpt["optimizer_states"]:
        fields = {f for per_param in optimizer["state"].values() for f in per_param}
        for field in fields:
            tensors = {
                name: s[field]
                for name, s in optimizer["state"].items()
                if isinstance(s.get(field), torch.Tensor) and s[field].dim() > 0
            }
            for name, tensor in convert(tensors).items():
                optimizer["state"][name][field] = tensor


def read_full(path: str | Path) -> dict:
    """Any file or DCP checkpoint as Lightning's checkpoint dict in the full form (see the module docstring).

    A DCP dir is gathered with torch's `dcp_to_torch_save` into a temporary file (it needs no process group);
    a file needs the parameter names train.py stores (NAMES_KEY) to name its numbered optimizer state."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = Path(path)
    if path.is_file():
        ckpt = safe_load.load(path, map_location="cpu", mmap=True)
        states, names = ckpt.get("optimizer_states", []), ckpt.pop(NAMES_KEY, None)
        if all(is_named(s) for s in states):  # FSDP2's save_distributed_checkpoint=false file: named already
            return ckpt
        if names is None:
            raise ConfigError(
                f"{path} holds no parameter names (written before they were stored), so its optimizer state cannot "
                "move to another strategy: resume it with trainer=ddp or one device, or start from its weights "
                f"with model.pretrained={path}."
            )
        ckpt["optimizer_states"] = [named_from_numbered(s, n) for s, n in zip(states, names)]
        return ckpt
    safe_load.check_dir(path)  # dcp_to_torch_save unpickles the dir's pickles with plain pickle
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, Path(tmp) / "full.pt")
        tensors = safe_load.load(Path(tmp) / "full.pt", map_location="cpu")
    ckpt = safe_load.load(path / METADATA, map_location="cpu")
    ckpt["state_dict"] = tensors.pop("state_dict")
    optimizers = sorted(k for k in tensors if k.startswith("optimizer_"))
    ckpt["optimizer_states"] = [
        tensors[k] if "param_groups" in tensors[k] else named_from_flat(tensors[k]) for k in optimizers
    ]
    ckpt.pop(NAMES_KEY, None)
    entry = ckpt.pop(LAYOUT_KEY, None)
    if entry is not None:
        relayout(ckpt, lambda sd: to_hf(sd, entry))
    return ckpt


def fit_to(named: dict, module: torch.nn.Module, optimizer: Any, weights: Optional[dict] = None) -> dict:
    """The named optimizer state arranged as `optimizer`'s groups: only its parameters (a pipeline stage holds some),
    in its order. A parameter the source had tied to another (GPT-2's head to its embedding: one parameter, where
    a pipeline's last stage holds its own copy) takes the state of the one it was tied to, found by its value."""
    groups = param_names(module, optimizer)
    hyper = {n: {k: v for k, v in g.items() if k != "params"} for g in named["param_groups"] for n in g["params"]}
    for name in [n for group in groups for n in group if n not in hyper and weights is not None and n in weights]:
        tied = [m for m in hyper if weights[m].shape == weights[name].shape and torch.equal(weights[m], weights[name])]
        if tied:
            hyper[name] = hyper[tied[0]]
            if tied[0] in named["state"]:
                named["state"][name] = named["state"][tied[0]]
    missing = [n for group in groups for n in group if n not in hyper]
    if missing:
        raise ConfigError(
            f"The checkpoint holds no optimizer state for {missing[0]} ({len(missing)} parameter(s) missing): it "
            "was written for another model; resume it with the model config it was trained with."
        )
    own = getattr(optimizer, "optimizer", optimizer).param_groups
    return {
        "state": {n: named["state"][n] for group in groups for n in group if n in named["state"]},
        "param_groups": [
            {**(hyper[names[0]] if names else {k: v for k, v in g.items() if k != "params"}), "params": list(names)}
            for names, g in zip(groups, own)
        ],
    }


def load_full(module: torch.nn.Module, optimizers: list, ckpt: dict, layout: Optional[dict] = None) -> dict:
    """Load the full form into a live, possibly sharded `module` and its optimizers; return the rest (loops, ...).

    Each rank keeps the entries it holds (a pipeline stage its own) and torch shards them into the target's
    DTensors (FSDP2, tensor parallel) or copies them (one device, DDP)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if layout is not None:  # a hand-written adapter's tensor-parallel layout (GPT-2's)
        relayout(ckpt, lambda sd: from_hf(sd, layout))
    sharded = any(isinstance(p, DTensor) for p in module.parameters())
    options = StateDictOptions(full_state_dict=sharded)
    held = set(get_model_state_dict(module))
    weights = ckpt.pop("state_dict")
    set_model_state_dict(module, {k: v for k, v in weights.items() if k in held}, options=options)
    for optimizer, named in zip(optimizers, ckpt.pop("optimizer_states")):
        optimizer = getattr(optimizer, "optimizer", optimizer)
        state = fit_to(named, module, optimizer, weights)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=state, options=options)
    return ckpt


def load(strategy: Any, path: str | Path, native: tuple[str, Optional[dict]], own_loader: Callable[[], dict]) -> dict:
    """A ModelParallel-based strategy's load_checkpoint: its `own_loader` for its own form `native` ((form, layout)),
    the full form for any other."""
    path = Path(strategy.broadcast(str(path)))
    form = form_of(path)
    if form != "file" and (form, stored_layout(path)) == native:
        with safe_load.allowed():  # Lightning's torch.load of meta.pt: weights_only=safe_load.weights_only()
            return own_loader()
    log.info(f"Resuming {path} ({form}) through the full form: each rank reads it whole, then keeps its part")
    module = strategy.lightning_module
    layout = native[1]
    return load_full(module, strategy.optimizers, read_full(path), layout)


class AnyFormCheckpointIO(AtomicCheckpointIO):
    """AtomicCheckpointIO whose reading side also takes a DCP dir (FSDP2, tensor parallel, pipeline), in the
    full form: the strategies that read files (DDP, one device) resume those too. `ResumeAnywhere` puts the
    named optimizer state into the numbered form once the optimizers exist."""

    def load_checkpoint(self, path, map_location: Optional[Callable] = None, weights_only: Optional[bool] = None):
        if Path(path).is_dir() and form_of(path) in ("dcp", "dcp_flat"):
            log.info(f"Resuming {path} (a DCP dir) through the full form")
            return read_full(path)
        if "://" not in str(path):
            return safe_load.load(path, map_location=map_location)
        with safe_load.allowed():  # remote storage: Lightning's fsspec read
            return super().load_checkpoint(path, map_location=map_location, weights_only=safe_load.weights_only())
