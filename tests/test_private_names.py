"""Canaries: every private (`_underscore`) name of a library that src/ still uses, each failing by name when the
library renames or drops it, so an upgrade breaks here and not silently in a run. One more lives beside its use:
`test_deepspeed.py::test_lightning_still_hands_the_layer_sync_plugin_to_the_strategy` (`strategy._layer_sync`),
`test_architectures.py::test_canary_transformers_init_weights_recomputes_rotary_buffers` (`_init_weights`)."""

from __future__ import annotations

import lightning as L
import pytest
import torch


def test_lightning_throughput_monitor_internals():
    """src/callbacks/throughput.py feeds ThroughputMonitor's counters and calls its _compute (it adds tokens, FLOPs
    and evaluation clocks that the public callback does not count)."""
    from lightning.pytorch.callbacks import ThroughputMonitor

    monitor = ThroughputMonitor(batch_size_fn=len)
    for name in ("_throughputs", "_t0s", "_lengths", "_samples", "_batches"):
        assert isinstance(getattr(monitor, name, None), dict), f"ThroughputMonitor.{name} is gone or changed"
    assert callable(getattr(monitor, "_compute", None)), "ThroughputMonitor._compute is gone"


def test_lightning_trainer_internals():
    """src/callbacks/throughput.py: `trainer.fit_loop._should_accumulate()` and
    `trainer._logger_connector.should_update_logs` decide the steps it logs, as Lightning's own callback does."""
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, max_steps=1)
    assert callable(getattr(trainer.fit_loop, "_should_accumulate", None)), "fit_loop._should_accumulate is gone"
    assert hasattr(type(trainer._logger_connector), "should_update_logs"), "_logger_connector.should_update_logs"


def test_lightning_checkpoint_loop_keys():
    """src/distributed/resume.py rewrites these entries of a checkpoint's fit-loop state (Lightning's checkpoint format,
    not an API) when a resume changes the batch shape or moves between automatic and manual optimization."""
    state = L.Trainer(logger=False, enable_checkpointing=False, max_steps=1).fit_loop.state_dict()
    for key in ("epoch_loop.batch_progress", "epoch_loop.automatic_optimization.optim_progress"):
        assert key in state, f"Lightning's fit-loop checkpoint has no {key!r}"
    assert set(state["epoch_loop.batch_progress"]["current"]) == {"ready", "started", "processed", "completed"}
    assert "step" in state["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]
    assert "total" in state["epoch_loop.manual_optimization.optim_step_progress"]


def test_lightning_hydra_subprocess_command():
    """src/distributed/hydra_ddp.py swaps Lightning's `_hydra_subprocess_cmd` for the command of a Hydra job's ranks."""
    from lightning.pytorch.strategies.launchers import subprocess_script

    assert callable(getattr(subprocess_script, "_hydra_subprocess_cmd", None)), "_hydra_subprocess_cmd is gone"


def test_lightning_deepspeed_format_config():
    """src/distributed/deepspeed.py overrides DeepSpeedStrategy._format_config to derive the batch keys itself."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    assert callable(getattr(DeepSpeedStrategy, "_format_config", None)), "DeepSpeedStrategy._format_config is gone"


def test_lightning_module_trainer_reference():
    """src/models/base.py reads `self._trainer`, which is None outside fit (the public `trainer` raises there)."""
    module = L.LightningModule()
    assert hasattr(module, "_trainer") and module._trainer is None, "LightningModule._trainer is gone"


def test_omegaconf_get_node():
    """src/utils/config.py walks `_target_` nodes with DictConfig._get_node, which does not resolve interpolations."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"a": {"_target_": "x"}, "b": "${a}"})
    assert cfg._get_node("b")._value() == "${a}", "DictConfig._get_node is gone or resolves now"


def test_transformers_attn_implementation():
    """src/distributed/pipeline_stages.py reads config._attn_implementation, where transformers keeps the choice."""
    from transformers import LlamaConfig

    assert LlamaConfig(attn_implementation="eager")._attn_implementation == "eager", "config._attn_implementation"


@pytest.mark.parametrize("name", ["_is_avx512_bf16_supported", "_is_amx_tile_supported"])
def test_torch_cpu_capability_probes(name):
    """src/utils/machine.py fastest_precision picks bf16 on CPUs these probes report; without them it falls back to
    fp32, which is safe but slow on such CPUs, so a rename should be seen."""
    assert callable(getattr(torch.cpu, name, None)), f"torch.cpu.{name} is gone"
