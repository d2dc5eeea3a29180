"""Checks before any work starts, so that what the user must fix is one sentence naming the key and the fix,
not an exception from deep inside Lightning, torch or a rank that has already started: configs the machine
cannot run, keys added with `+` that nothing reads, values out of range, unusable paths and checkpoints."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from src.checkpoint.files import problem
from src.core.datamodule import micro_batch_size
from src.core.dropout import wants_kernel
from src.launch.choices import CONF
from src.lm.features import compiling
from src.parallel import capabilities
from src.utils.config import ConfigError, EvalConfig, GenerateConfig, TrainConfig, check_int, check_number
from src.utils.errors import CheckpointError, PathNotFound
from src.utils.machine import fastest_precision

log = logging.getLogger(__name__)


def declared(trainer_cfg: DictConfig) -> Any:
    """What the configured strategy declares (src/parallel/capabilities.py): its `_target_` class's, or a name's of
    Lightning's registry ("ddp", "fsdp", ...); the defaults for "auto"."""
    strategy = trainer_cfg.get("strategy", "auto")
    if isinstance(strategy, DictConfig):
        strategy = get_object(strategy._target_) if "_target_" in strategy else None
    return capabilities.of(strategy if strategy is None or isinstance(strategy, type) else str(strategy))


def check_machine(trainer_cfg: DictConfig) -> None:
    """One clear sentence, instead of a stack trace from deep inside, when the machine cannot run the config."""
    import torch

    devices = trainer_cfg.get("devices", "auto")
    if isinstance(devices, int) and not isinstance(devices, bool) and devices < 1 and devices != -1:
        raise ConfigError(f"trainer.devices={devices} is not valid: use a number of devices >= 1, -1 or auto.")
    if torch.cuda.is_available():
        if isinstance(devices, int) and devices > torch.cuda.device_count():
            raise ConfigError(
                f"trainer.devices={devices} but this machine has {torch.cuda.device_count()} visible "
                "CUDA GPU(s): lower trainer.devices (or -1 for all), or check CUDA_VISIBLE_DEVICES."
            )
        return
    needs_cuda = declared(trainer_cfg).requires_cuda  # DeepSpeed's, Lightning's FSDP1's sentence
    if needs_cuda:
        raise ConfigError(needs_cuda)
    if str(trainer_cfg.get("accelerator", "auto")) in ("gpu", "cuda"):
        raise ConfigError(
            "trainer.accelerator=gpu needs a CUDA GPU and none is visible here. "
            "Use trainer=cpu, or trainer=ddp for 2 CPU processes."
        )
    if str(trainer_cfg.get("precision", "32")).startswith("16"):
        raise ConfigError(
            f"trainer.precision={trainer_cfg.precision} needs a GPU: on CPU Lightning would silently "
            "train in bf16 instead. Use trainer.precision=bf16-mixed or 32-true."
        )
    if "bf16" in str(trainer_cfg.get("precision", "32")) and fastest_precision("cpu") == "32-true":
        # measured on an AVX2-only AMD EPYC: 40 steps of the 4-layer GPT took 230 s in bf16-mixed, 23 s in fp32
        log.warning(
            f"trainer.precision={trainer_cfg.precision} on a CPU without AVX512-BF16 or AMX: bf16 has no fast "
            "matmul path here and trains ~10x slower than fp32. Use trainer.precision=32-true (the default "
            "on this CPU) unless you need bf16's numerics."
        )


OPT_IN_KEYS = {"resume_with_new_batch"}  # added with `+` on purpose (conf/train.yaml says what each does)


def check_top_level_keys(cfg: DictConfig) -> None:
    """A key added with `+` (`+max_step=5`) bypasses the schema when Hydra composes: refuse it here."""
    from dataclasses import fields

    schema = TrainConfig if "train" in cfg else GenerateConfig if "chat" in cfg else EvalConfig
    known = {f.name for f in fields(schema)} | OPT_IN_KEYS
    for key in cfg:
        if key not in known and key != "hydra":
            raise ConfigError(
                f"Unknown config key '{key}': nothing reads it. Check the spelling (e.g. "
                f"trainer.max_steps); top-level keys are: {', '.join(sorted(known))}."
            )


def resolve_and_check_values(cfg: DictConfig) -> None:
    """Resolves model.compile=auto in `cfg` (resolve_auto_compile), then checks the values whose failure would come
    late or from deep inside a library."""
    resolve_auto_compile(cfg)
    for key in ("data.seq_len", "data.global_batch_size"):  # others interpolate them: name them before they resolve
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None:
            check_int(key, value)
    trainer = cfg.trainer
    strategy = declared(trainer)
    _check_module_fits(cfg, strategy)
    if strategy.check_config is not None:  # a strategy's own checks (trainer=tp, pipeline)
        strategy.check_config(cfg)
    if cfg.get("train", False):
        steps, epochs = trainer.get("max_steps", -1), trainer.get("max_epochs", None)
        check_number("trainer.max_steps", steps, lambda v: v >= 1 or v == -1, "a positive number of optimizer steps",
                     integer=True)  # fmt: skip
        _check_global_batch(cfg)
        if steps == -1 and epochs in (None, -1) and cfg.model.get("scheduler") is not None:
            raise ConfigError(
                "trainer.max_steps=-1 with trainer.max_epochs=-1 never ends, and the LR schedule "
                "(model.scheduler) needs a length: set trainer.max_steps=N or trainer.max_epochs=N."
            )
    _check_objective(cfg)
    _check_features(cfg)
    _check_adapters(cfg)
    _check_benchmarks(cfg)
    if cfg.get("compile_dropout") is not None:  # before the data is built (train.py's UserModule applies it)
        wants_kernel(cfg.compile_dropout, torch.device("cpu"))
    lr = OmegaConf.select(cfg, "model.optimizer.lr", default=None)
    if lr is not None:
        check_number("model.optimizer.lr", lr, lambda v: v > 0, "a positive learning rate, e.g. 3e-4")
    pretrained = OmegaConf.select(cfg, "model.pretrained", default=None)
    is_path = isinstance(pretrained, str) and pretrained.startswith(("/", ".", "~"))  # not a hub name
    if is_path and not Path(pretrained).expanduser().exists():
        raise PathNotFound(
            f"model.pretrained={pretrained!r} does not exist: pass a dir with config.json + "
            "model.safetensors (save_pretrained's output), a checkpoint of this template (its weights), "
            "or a hub name such as gpt2 when online."
        )

    ckpt = cfg.get("ckpt_path")
    for key, path in (("ckpt_path", ckpt), ("model.pretrained", pretrained if is_path else None)):
        why = (
            problem(path)
            if path and (key == "ckpt_path" or not (Path(path).expanduser() / "config.json").exists())
            else None
        )
        if why is not None:
            raise CheckpointError(
                f"{key}={path!r} cannot be used: {why}. Point it at a checkpoint written by "
                "train.py, e.g. logs/train/runs/<run>/checkpoints/last.ckpt"
                + (", or a Hugging Face dir." if key == "model.pretrained" else ".")
            )
    for key in ("log_dir", "cache_dir", "output_dir"):
        _check_writable(f"paths.{key}", Path(cfg.paths[key]))


def _check_module_fits(cfg: DictConfig, strategy: type) -> None:
    """A strategy that shards through LitModule's interface (FSDP2, DeepSpeed, tensor parallel, the pipeline) gets one."""
    target = OmegaConf.select(cfg, "model._target_", default=None)
    if not target:
        return
    from src.core.module import LitModule

    module, option = get_object(target), trainer_option(cfg)
    if not strategy.takes_plain_modules and not (isinstance(module, type) and issubclass(module, LitModule)):
        raise ConfigError(
            f"trainer={option} shards the model through src/core/module.py's LitModule (its blocks() and networks()), "
            f"and {target} is not one: build it on LitModule (docs/your-model.md) or use trainer=ddp."
        )


def trainer_option(cfg: DictConfig) -> str:
    """The trainer= option the run composed (Hydra's choice), else the first of conf/trainer/ with its strategy."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized() and HydraConfig.get().runtime.choices.get("trainer"):
        return HydraConfig.get().runtime.choices["trainer"]
    target = OmegaConf.select(cfg, "trainer.strategy._target_", default=None)
    for path in sorted((CONF / "trainer").glob("*.yaml")):
        if target and OmegaConf.select(OmegaConf.load(path), "strategy._target_", default=None) == target:
            return path.stem
    return str(target).rsplit(".", 1)[-1]


def data_options(batch_kind: str) -> list[str]:
    """The data options (conf/data/) whose datamodule holds `batch_kind`, read from their targets."""
    options = []
    for path in sorted((CONF / "data").glob("*.yaml")):
        target = OmegaConf.load(path).get("_target_")
        if target and getattr(get_object(target), "batch_kind", None) == batch_kind:
            options.append(path.stem)
    return options


def _check_objective(cfg: DictConfig) -> None:
    """The objective trains on the kind of batch the data holds (DPO on preference pairs, SFT on tokens); the
    pipeline schedule computes the next-token loss only."""
    objective = OmegaConf.select(cfg, "model.objective", default=None)
    data = OmegaConf.select(cfg, "data._target_", default=None)
    if not isinstance(objective, DictConfig) or "_target_" not in objective or not data:  # convnet: no objective
        return
    objective, data = get_object(objective._target_), get_object(data)
    name, kind = objective.name, objective.batch_kind
    data_kind = getattr(data, "batch_kind", "tokens")
    if kind != data_kind:
        raise ConfigError(
            f"model/objective={name} trains on {kind}, but data is {data.__name__}, which holds {data_kind}: use "
            f"data={' or '.join(data_options(kind))}, or another model/objective (conf/model/objective/)."
        )
    strategy = declared(cfg.trainer)
    for capability in objective.refused_under:
        why = getattr(strategy, capability)
        if why:
            raise ConfigError(
                f"model/objective={name} does not run under trainer={trainer_option(cfg)} ({why}); use "
                "trainer=ddp, fsdp or deepspeed."
            )


def resolve_auto_compile(cfg: DictConfig) -> None:
    """model.compile=auto becomes true, blocks or false for this run (src/lm/features/compiling.py, auto_compile), in the
    config itself, before anything reads it: the same on every rank (the same config, the same kind of device)."""
    if OmegaConf.select(cfg, "model.compile", default=None) != "auto":
        return
    trainer = cfg.trainer
    on_gpu = trainer.get("accelerator", "auto") in ("auto", "gpu", "cuda") and torch.cuda.is_available()
    steps = trainer.get("max_steps", -1) if cfg.get("train", False) else None
    check = declared(trainer).check_config

    def accepts(region: Any) -> bool:  # the strategy's own checks, with model.compile set to `region`
        if check is None:
            return True
        trial = cfg.copy()
        trial.model.compile = region
        try:
            check(trial)
        except ConfigError:
            return False
        return True

    chunk = OmegaConf.select(cfg, "model.loss_chunk", default=None)
    cfg.model.compile = compiling.auto_compile(on_gpu, steps, cfg.model.get("compile_mode"), chunk, accepts)
    where = "a GPU" if on_gpu else "no GPU"
    log.info(f"model.compile=auto: {str(cfg.model.compile).lower()} ({where}, {steps} training steps)")


def _check_features(cfg: DictConfig) -> None:
    """The LM module's features (src/models/) under the configured strategy, by its capabilities: model.loss_chunk
    (chunked_loss.py) and model.pad_vocab_multiple (padded_vocab.py), each refusal in its feature's module."""
    strategy = OmegaConf.select(cfg, "trainer.strategy", default=None)
    if not isinstance(strategy, DictConfig) or "_target_" not in strategy:
        return
    from src.lm.features import chunked_loss, padded_vocab

    caps, name = declared(cfg.trainer), str(strategy._target_).rsplit(".", 1)[-1]
    chunked_loss.check_strategy(OmegaConf.select(cfg, "model.loss_chunk", default=None), caps, strategy.get("stage"))
    padded_vocab.check_strategy(OmegaConf.select(cfg, "model.pad_vocab_multiple", default=None), caps, name)


def _check_adapters(cfg: DictConfig) -> None:
    """model.freeze (src/lm/features/frozen.py) and the bottleneck adapters' options (src/lm/features/bottleneck.py)."""
    peft = OmegaConf.select(cfg, "model.peft", default=None)
    if isinstance(peft, DictConfig) and str(peft.get("_target_", "")).endswith("bottleneck.BottleneckConfig"):
        from src.lm.features.bottleneck import BottleneckConfig

        try:
            BottleneckConfig(**{k: v for k, v in OmegaConf.to_container(peft, resolve=True).items() if k != "_target_"})
        except (TypeError, ValueError) as error:
            raise ConfigError(str(error)) from None
    freeze = OmegaConf.select(cfg, "model.freeze", default=None)
    if freeze is not None:
        from src.lm.features import frozen as freezing

        lora = OmegaConf.select(cfg, "model.lora.enabled", default=False)
        freezing.check(OmegaConf.to_container(freeze) if isinstance(freeze, DictConfig) else freeze, lora or bool(peft))


def _check_benchmarks(cfg: DictConfig) -> None:
    """callbacks.benchmarks (src/lm/callbacks/benchmarks.py): tasks named, lm-eval installed, and, as generate.py's
    tasks=, a strategy under which every rank holds the whole model."""
    bench = OmegaConf.select(cfg, "callbacks.benchmarks", default=None)
    if not isinstance(bench, DictConfig):
        return
    if not bench.get("tasks"):
        raise ConfigError("callbacks.benchmarks names no tasks: set callbacks.benchmarks.tasks=[hellaswag,...].")
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(
            "callbacks.benchmarks needs lm-evaluation-harness, which is not installed: pip install -e '.[bench]'."
        )
    strategy = OmegaConf.select(cfg, "trainer.strategy", default=None)
    if not isinstance(strategy, DictConfig) or "_target_" not in strategy:
        return
    caps = declared(cfg.trainer)
    if caps.generation in ("lockstep", None) or (caps.zero_stages and strategy.get("stage") == 3):
        raise ConfigError(
            f"callbacks.benchmarks runs where every rank holds the whole model: use trainer=default or trainer=ddp, "
            f"not {str(strategy._target_).rsplit('.', 1)[-1]} (it shards the parameters, so its ranks would run "
            "different numbers of forwards)."
        )


def _check_global_batch(cfg: DictConfig) -> None:
    """The global batch must split evenly over the ranks: checked here, once, before the ranks start (the
    datamodule checks again in setup, where the world size is known for sure)."""
    batch = OmegaConf.select(cfg, "data.global_batch_size", default=None)
    sizes = [cfg.trainer.get(k, 1) for k in ("devices", "num_nodes", "accumulate_grad_batches")]
    if batch is None or not all(isinstance(n, int) and n > 0 for n in sizes):  # "auto", -1: known only later
        return
    strategy = cfg.trainer.get("strategy")
    model_parallel = 1  # pipeline stages x tensor-parallel ranks: the ranks of one group read the same samples
    if isinstance(strategy, DictConfig):
        for key in ("pipeline_parallel_size", "tensor_parallel_size"):
            size = strategy.get(key, 1)
            model_parallel *= size if isinstance(size, int) and size > 0 else 1
    ranks = sizes[0] * sizes[1]
    replicas, layout, key, split = (
        ranks,
        f"{sizes[0]} device(s) x {sizes[1]} node(s)",
        "trainer.accumulate_grad_batches",
        sizes[2],
    )
    if model_parallel > 1 and ranks % model_parallel == 0:  # (a world size that does not divide: mesh.py says so)
        replicas = ranks // model_parallel
        layout = f"{replicas} data-parallel replica(s)"
        if isinstance(strategy.get("n_microbatches"), int):  # the pipeline cuts a replica's share into its own
            key, split = "trainer.strategy.n_microbatches", strategy.n_microbatches
    micro_batch_size(batch, replicas, split, ranks=layout, split_key=key)


def _check_writable(key: str, path: Path) -> None:
    existing = next((p for p in [path, *path.parents] if p.exists()), None)
    if existing is not None and (not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK)):
        what = "is not a dir" if not existing.is_dir() else "is not writable"
        raise ConfigError(f"{key}={str(path)!r} cannot be created: {existing} {what}. Set {key} to a writable dir.")
