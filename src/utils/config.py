"""Config schema and checks: a key nobody reads must be an error, never silently ignored.

Two layers catch typos before any work starts:
- the dataclass schemas below make Hydra reject unknown *top-level* keys while composing;
- `check_targets` binds every `_target_` node's keys against the target's signature, so
  `model.optimizer.lrr=1e-3` fails at start-up, not hours later in `configure_optimizers`.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from hydra.utils import get_object
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from src.utils.errors import UserError


class ConfigError(UserError, ValueError):
    """A config value or key that cannot work; the message names the key and the fix."""


class ArchitectureRefused(ConfigError):
    """A strategy that cannot split this architecture exactly, found when the ranks hold the model: every rank
    reaches the same verdict from the same model, so `user_errors` prints it once (rank 0)."""

    same_on_every_rank = True


@dataclass
class PathsConfig:
    root_dir: str = MISSING
    data_dir: str = MISSING
    cache_dir: str = MISSING
    log_dir: str = MISSING
    output_dir: str = MISSING


@dataclass
class ExtrasConfig:
    print_config: bool = True  # print the resolved config as a tree (rank 0) and save it in the run dir


@dataclass
class RunConfig:
    """Keys shared by train.py and eval.py; the groups (data, model, ...) are checked by check_targets."""

    task_name: str = MISSING
    tags: list[str] = field(default_factory=list)
    seed: Optional[int] = 42
    float32_matmul_precision: str = "highest"
    paths: PathsConfig = field(default_factory=PathsConfig)
    extras: ExtrasConfig = field(default_factory=ExtrasConfig)
    data: Any = MISSING
    model: Any = MISSING
    trainer: Any = MISSING
    callbacks: Any = None
    logger: Any = None
    trust_checkpoint: bool = False


@dataclass
class TrainConfig(RunConfig):
    task_name: str = "train"
    train: bool = True
    test: bool = True
    ckpt_path: Optional[str] = None
    resume: Optional[str] = None
    optimized_metric: Optional[str] = "val/loss"
    compile_dropout: Any = "auto"


@dataclass
class EvalConfig(RunConfig):
    task_name: str = "eval"
    ckpt_path: str = MISSING


@dataclass
class GenerateConfig(EvalConfig):
    task_name: str = "generate"
    prompt: Optional[str] = None
    prompts_file: Optional[str] = None
    output: Optional[str] = None
    chat: bool = False
    chat_template: Optional[str] = None
    system: Optional[str] = None
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    tasks: Any = None  # a list of lm-eval task names
    include_path: Optional[str] = None
    num_fewshot: Optional[int] = None
    limit: Optional[float] = None
    batch_size: int = 8


def register_schemas() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="eval_schema", node=EvalConfig)
    cs.store(name="generate_schema", node=GenerateConfig)


def check_targets(cfg: Any, key: str = "") -> None:
    """Raise ConfigError for any `_target_` node with a key its target does not accept."""
    if isinstance(cfg, ListConfig):
        for i, item in enumerate(cfg):
            check_targets(item, f"{key}[{i}]")
        return
    if not isinstance(cfg, DictConfig):
        return
    if "_target_" in cfg:
        target = cfg._target_
        hydra_log = logging.getLogger("hydra.utils")  # which logs the failure itself, as a paragraph
        level, hydra_log.level = hydra_log.level, logging.CRITICAL
        try:
            obj = get_object(target)
        except Exception as e:  # ImportError, AttributeError, ...
            reason = str(e.__cause__ or e).strip().splitlines()[0]
            raise ConfigError(
                f"{key}._target_={target!r} cannot be imported ({reason}): fix the name or install it."
            ) from e
        finally:
            hydra_log.level = level
        params = accepted_parameters(obj)
        accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        if params and not accepts_any:
            for name in cfg:
                if not str(name).startswith("_") and name not in params:
                    known = ", ".join(p for p in params if p not in ("self", "args", "kwargs"))
                    raise ConfigError(
                        f"Unknown config key '{key}.{name}': {target} does not take '{name}'. "
                        f"Check the spelling; accepted keys are: {known}."
                    )
    for name, node in cfg.items_ex(resolve=False):  # interpolations stay strings: nothing is resolved here
        if name == "hydra":
            continue
        check_targets(node, f"{key}.{name}" if key else str(name))


def accepted_parameters(obj: Any) -> dict[str, inspect.Parameter]:
    """The keyword parameters `obj` accepts. A class whose `__init__` passes `**kwargs` on to its base's accepts the
    base's too (GPT2LitModule adds GPT-2's shape keys to CausalLMLitModule's options, typed once there; each
    datamodule adds its own keys to the shared ones of ShardedDataModule), and so does a subclass that inherits
    such an `__init__`."""
    try:
        params = dict(inspect.signature(obj).parameters)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return {}
    rest = [name for name, p in params.items() if p.kind is inspect.Parameter.VAR_KEYWORD]
    owners = [b for b in getattr(obj, "__mro__", ()) if "__init__" in vars(b) and b is not object]  # [its, base's]
    if rest and len(owners) > 1:
        del params[rest[0]]
        return {**params, **{k: v for k, v in accepted_parameters(owners[1]).items() if k not in params}}
    return params


def flatten(d: dict, prefix: str = ""):
    """(a/b/c, value) for each leaf of a nested dict; a value that is no bool, number or string as its text."""
    for key, value in d.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict):
            yield from flatten(value, name)
        else:
            yield name, value if isinstance(value, (bool, int, float, str)) else str(value)


def instantiate_group(
    cfg: Optional[DictConfig], key: str, extra: Optional[Callable[[DictConfig], dict]] = None
) -> list[Any]:
    """Instantiate every `_target_` entry of a dict group such as `callbacks` or `logger`; `extra(node)`: keyword
    arguments to add to an entry."""
    from hydra.utils import instantiate

    if not cfg:
        return []
    objects = []
    for name, node in cfg.items():
        if node is None:  # `callbacks.generate_text=null` switches one entry off
            continue
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigError(f"{key}.{name} must be a config with a _target_, got: {node}")
        objects.append(instantiate(node, **(extra(node) if extra else {})))
    return objects


# model switches a strategy may not support yet, as the user writes them
SWITCHES = {
    "model.lora.enabled": "model.lora.enabled=true",
    "model.peft": "model/peft",
    "model.compile": "model.compile=true",
    "model.freeze": "model.freeze",
}


def check_unsupported(cfg: DictConfig, strategy: str, keys: tuple[str, ...]) -> None:
    """One sentence for the first of the `keys` (of SWITCHES) that is on: `trainer={strategy}` does not support it."""
    for key in keys:
        if OmegaConf.select(cfg, key, default=None) not in (None, False):
            raise ConfigError(
                f"{SWITCHES[key]} is not supported with trainer={strategy} yet: turn it off, or train with "
                "trainer=ddp or trainer=fsdp."
            )


def check_number(key: str, value: Any, valid: Callable[[Any], bool], use: str, integer: bool = False) -> None:
    """`key` must be a number (an integer where `integer`; never a bool, nor a string from the command line) that
    `valid` accepts; else one sentence, `{key}={value} is not valid: use {use}.`"""
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not valid(value):
        raise ConfigError(f"{key}={value!r} is not valid: use {use}.")


def check_int(key: str, value: Any, minimum: int = 1) -> None:
    """`key` must be an integer >= minimum (a string or float from the command line is named, not divided by)."""
    check_number(key, value, lambda v: v >= minimum, f"an integer >= {minimum}", integer=True)


def world_size(trainer: Any) -> Optional[int]:
    """trainer.devices x trainer.num_nodes (a list of devices counts its length), or None where the config leaves it
    to the machine ("auto", -1): known only once the ranks start."""
    devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
    devices = len(devices) if isinstance(devices, (list, ListConfig)) else devices
    return devices * nodes if isinstance(devices, int) and devices > 0 and isinstance(nodes, int) else None


def check_fractions(val_key: str, val: Any, test_key: str, test: Any) -> None:
    """Val and test fractions each in [0, 1), leaving some data to train on."""
    for key, value in ((val_key, val), (test_key, test)):
        check_number(key, value, lambda v: 0 <= v < 1, "a fraction of the data in [0, 1), e.g. 0.05")
    if val + test >= 1:
        raise ConfigError(f"{val_key}={val} + {test_key}={test} leave nothing to train on: their sum must be < 1.")


def check_prompt_len(seq_len: int, max_prompt_len: Optional[int], after: str) -> int:
    """data.max_prompt_len (None: half of seq_len), checked to leave room in data.seq_len for `after`."""
    max_prompt_len = seq_len // 2 if max_prompt_len is None else max_prompt_len
    check_int("data.max_prompt_len", max_prompt_len)
    if max_prompt_len >= seq_len:
        raise ConfigError(
            f"data.max_prompt_len={max_prompt_len} leaves no room for {after} in data.seq_len={seq_len}: lower it "
            "below seq_len."
        )
    return max_prompt_len
