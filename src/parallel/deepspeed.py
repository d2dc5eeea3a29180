"""DeepSpeed ZeRO (stages 1/2/3, CPU offload) with a config derived from ours, so the two always agree.

The DeepSpeed JSON repeats facts that our config already decides: batch sizes, accumulation,
precision, clipping, the optimizer. We derive them (`train_batch_size = micro x accumulation x
world`), accept a user's own ds_config.json for everything else, resolve its "auto" values, and
raise a clear error where it contradicts the run. With optimizer offload, DeepSpeed needs its
own CPU Adam (a torch optimizer makes it raise ZeRORuntimeException), so we swap it in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeed
from lightning.pytorch.strategies.deepspeed import _format_precision_config
from omegaconf import DictConfig, OmegaConf

from src.checkpoint import safe_load
from src.checkpoint.sharded import ShardedCheckpoints
from src.parallel.capabilities import DEEPSPEED_NEEDS_CUDA, Capabilities
from src.parallel.sync_batchnorm import apply_layer_sync
from src.utils.config import ConfigError

OURS = {  # DeepSpeed key -> the config keys that decide it here
    "train_micro_batch_size_per_gpu": "data.global_batch_size / (devices x nodes x accumulation)",
    "gradient_accumulation_steps": "trainer.accumulate_grad_batches",
    "train_batch_size": "data.global_batch_size",
    "gradient_clipping": "trainer.gradient_clip_val",
}


def derive_config(
    user: dict[str, Any], stage: int, micro: int, accumulation: int, world: int, clip: Optional[float], precision: str
) -> dict[str, Any]:
    """The user's DeepSpeed config, filled in from ours; ConfigError on any contradiction.

    Beside Lightning's own filling-in (the micro-batch from the train loader, accumulation and clipping from the
    Trainer), this also sets train_batch_size to data.global_batch_size, and checks every such key the user wrote
    against ours: a contradiction is one sentence naming both values."""
    config = json.loads(json.dumps(user))  # deep copy
    derived = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro * accumulation * world,
        "gradient_clipping": float(clip or 0.0),
    }
    for key, value in derived.items():
        theirs = config.get(key, "auto")
        if theirs != "auto" and theirs != value:
            raise ConfigError(
                f"ds_config {key}={theirs!r} contradicts this run's {value!r} (from {OURS[key]}). "
                f'Remove it from the JSON (or set it to "auto") and change {OURS[key]} instead.'
            )
        config[key] = value
    zero = config.setdefault("zero_optimization", {})
    if zero.get("stage", "auto") not in ("auto", stage):
        raise ConfigError(
            f"ds_config zero_optimization.stage={zero['stage']} contradicts trainer.strategy.stage={stage}."
        )
    zero["stage"] = stage
    for key in ("optimizer", "scheduler"):
        if key in config:
            raise ConfigError(
                f"ds_config has an {key!r} section: set it in model.{key} instead, so one config "
                "decides it (offload gets DeepSpeed's CPU Adam automatically)."
            )
    wants = {"16-mixed": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16", "16-true": "fp16"}.get(precision)
    for kind in ("fp16", "bf16"):
        enabled = config.get(kind, {}).get("enabled", "auto")
        if enabled == "auto":
            config.pop(kind, None)  # filled below from trainer.precision
        elif enabled and kind != wants:
            raise ConfigError(f"ds_config {kind}.enabled=true contradicts trainer.precision={precision}.")
    return config


def place_states(module: torch.nn.Module, device: torch.device) -> None:
    """Every torchmetrics metric and every buffer of `module` onto `device`, parameters untouched. Under ZeRO-3
    neither DeepSpeed (a model built under zero.Init is left where it is) nor Lightning's DeepSpeed strategy (unlike
    its FSDP one) moves the rest of the LightningModule: the evaluation metrics, built with the objective outside
    zero.Init, stay on the CPU and the first validation on a GPU stops ("different devices in metric
    calculation")."""
    from torchmetrics import Metric

    for metric in (m for m in module.modules() if isinstance(m, Metric)):
        metric.to(device)  # its states, in place
    for owner in module.modules():
        for name, buffer in owner.named_buffers(recurse=False):
            if buffer.device != device:
                setattr(owner, name, buffer.to(device))  # the registered buffer replaced, persistence kept


class DeepSpeedStrategy(ShardedCheckpoints, LightningDeepSpeed, Capabilities):
    requires_cuda = DEEPSPEED_NEEDS_CUDA  # Lightning's DeepSpeed refuses CPU: src/run/checks.py says so first
    takes_plain_modules = False  # configure_model and the loss's scaling for its accumulation are LitModule's
    checkpoint_form = "deepspeed"  # its ZeRO dirs (ShardedCheckpoints writes them atomically)
    zero_stages = True

    @property
    def generation(self) -> str:  # ZeRO-3 partitions the parameters; stages 1 and 2 keep them whole on every rank
        return "lockstep" if self.zero_stage_3 else "alone"

    def __init__(
        self,
        stage: int = 2,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        config: Optional[Union[str, dict]] = None,
        **kwargs: Any,
    ) -> None:
        if stage not in (1, 2, 3):
            raise ConfigError(f"trainer.strategy.stage={stage}: DeepSpeed ZeRO has stages 1, 2 and 3.")
        if offload_parameters and stage != 3:
            raise ConfigError("trainer.strategy.offload_parameters needs stage=3 (only sharded parameters offload).")
        if isinstance(config, DictConfig):  # given inline: trainer.strategy.config='{zero_optimization: {...}}'
            config = OmegaConf.to_container(config, resolve=True)
        if isinstance(config, (str, Path)):
            path = Path(config).expanduser()
            if not path.is_file():
                raise ConfigError(f"trainer.strategy.config={config!r}: no such DeepSpeed JSON file.")
            try:
                config = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{e.lineno}: not valid JSON ({e.msg}).") from e
        super().__init__(
            stage=stage, offload_optimizer=offload_optimizer, offload_parameters=offload_parameters, **kwargs
        )
        self.user_config = dict(config or {})
        # With optimizer offload, ZeRO steps on the CPU with DeepSpeed's own Adam (read by LitModule).
        self.optimizer_class = None
        if offload_optimizer:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            self.optimizer_class = DeepSpeedCPUAdam

    @property
    def meta_init(self) -> bool:
        """ZeRO-3: train.py builds the model on meta; CausalLMLitModule.configure_model builds it again inside
        Lightning's deepspeed.zero.Init, so each parameter is partitioned as it is made."""
        return self.zero_stage_3

    def setup(self, trainer) -> None:
        apply_layer_sync(self, self.lightning_module)  # trainer.plugins' SyncBatchNorm: Lightning skips DeepSpeed
        super().setup(trainer)
        place_states(self.lightning_module, self.root_device)

    def _format_config(self) -> None:
        trainer = self.lightning_module.trainer
        base = {**self.config, **self.user_config}  # Lightning's defaults for the stage/offload, then the user's
        base["zero_optimization"] = {
            **self.config.get("zero_optimization", {}),
            **self.user_config.get("zero_optimization", {}),
        }
        self.config = derive_config(
            base,
            self.config["zero_optimization"]["stage"],
            trainer.datamodule.batch_size,
            trainer.accumulate_grad_batches,
            trainer.world_size,
            trainer.gradient_clip_val,
            str(self.precision_plugin.precision),
        )
        _format_precision_config(
            config=self.config,
            precision=self.precision_plugin.precision,
            loss_scale=self.loss_scale,
            loss_scale_window=self.loss_scale_window,
            min_loss_scale=self.min_loss_scale,
            initial_scale_power=self.initial_scale_power,
            hysteresis=self.hysteresis,
        )

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """DeepSpeed unpickles its files with plain pickle: a dir holding anything the template does not write is
        refused first (src/checkpoint/safe_load.py). Its ZeRO dirs only: ShardedCheckpoints' save, not its load."""
        safe_load.check_dir(checkpoint_path)
        return LightningDeepSpeed.load_checkpoint(self, checkpoint_path, weights_only)
