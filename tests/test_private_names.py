"""Canaries: every private (`_underscore`) name of a library that src/ still uses, each failing by name when the
library renames or drops it, so an upgrade breaks here and not silently in a run. Others live beside their use:
`test_deepspeed.py::test_lightning_still_hands_the_layer_sync_plugin_to_the_strategy` (`strategy._layer_sync`),
`test_architectures.py::test_canary_transformers_init_weights_recomputes_rotary_buffers` (`_init_weights`),
`test_meta_init.py::test_canary_transformers_init_skips_tensors_marked_initialised` (`_is_hf_initialized`);
transformers' attention flags are here."""

from __future__ import annotations

import lightning as L
import pytest
import torch


def test_lightning_checkpoint_loop_keys():
    """src/callbacks/resume_anywhere.py rewrites these entries of a checkpoint's fit-loop state (Lightning's checkpoint format,
    not an API) when a resume changes the batch shape or moves between automatic and manual optimization."""
    state = L.Trainer(logger=False, enable_checkpointing=False, max_steps=1).fit_loop.state_dict()
    for key in ("epoch_loop.batch_progress", "epoch_loop.automatic_optimization.optim_progress"):
        assert key in state, f"Lightning's fit-loop checkpoint has no {key!r}"
    assert set(state["epoch_loop.batch_progress"]["current"]) == {"ready", "started", "processed", "completed"}
    assert "step" in state["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]
    assert "total" in state["epoch_loop.manual_optimization.optim_step_progress"]


def test_lightning_hydra_subprocess_command():
    """src/launch/hydra_ddp.py swaps Lightning's `_hydra_subprocess_cmd` for the command of a Hydra job's ranks."""
    from lightning.pytorch.strategies.launchers import subprocess_script

    assert callable(getattr(subprocess_script, "_hydra_subprocess_cmd", None)), "_hydra_subprocess_cmd is gone"


def test_lightning_child_process_observer():
    """src/launch/hydra_ddp.py empties the `_child_processes` list of Lightning's observer thread (found by its
    name) before it reaps a finished Hydra job's ranks itself."""
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    observer = _ChildProcessObserver(main_pid=0, child_processes=[])
    assert observer.name == "child-process-observer", "Lightning's observer thread has another name"
    assert observer._child_processes == [], "_ChildProcessObserver._child_processes is gone"


def test_lightning_model_parallel_sizes():
    """FSDP2Strategy, TensorParallelStrategy and PipelineStrategy set ModelParallelStrategy's `_data_parallel_size` and
    `_tensor_parallel_size` in setup_environment, where the world size is known (its public arguments are fixed at
    construction), before Lightning builds its (data_parallel, tensor_parallel) mesh from them."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size=3, tensor_parallel_size=2)
    assert (getattr(strategy, "_data_parallel_size", None), getattr(strategy, "_tensor_parallel_size", None)) == (
        3,
        2,
    ), "ModelParallelStrategy._data_parallel_size / _tensor_parallel_size are gone or changed"


def test_lightning_deepspeed_format_config():
    """src/parallel/deepspeed.py overrides DeepSpeedStrategy._format_config to derive the batch keys itself."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    assert callable(getattr(DeepSpeedStrategy, "_format_config", None)), "DeepSpeedStrategy._format_config is gone"


def test_lightning_deepspeed_precision_config():
    """src/parallel/deepspeed.py fills DeepSpeed's precision keys with Lightning's `_format_precision_config`, as
    Lightning's own `_format_config` (which it overrides) does."""
    from lightning.pytorch.strategies import deepspeed

    assert callable(getattr(deepspeed, "_format_precision_config", None)), "_format_precision_config is gone"


def test_torch_batchnorm_base_class():
    """src/parallel/sync_batchnorm.py subclasses `torch.nn.modules.batchnorm._BatchNorm` (as torch's SyncBatchNorm
    does) and finds every BatchNorm by it."""
    from torch.nn.modules import batchnorm

    assert issubclass(torch.nn.BatchNorm2d, batchnorm._BatchNorm), "torch.nn.modules.batchnorm._BatchNorm is gone"
    assert issubclass(torch.nn.SyncBatchNorm, batchnorm._BatchNorm)


@pytest.mark.parametrize("name", ["_is_avx512_bf16_supported", "_is_amx_tile_supported"])
def test_torch_cpu_capability_probes(name):
    """src/utils/machine.py fastest_precision picks bf16 on CPUs these probes report; without them it falls back to
    fp32, which is safe but slow on such CPUs, so a rename should be seen."""
    assert callable(getattr(torch.cpu, name, None)), f"torch.cpu.{name} is gone"


def test_transformers_attention_support_flags():
    """src/lm/hf.py `supported_attention` reads transformers' class flags `_supports_sdpa`, `_supports_flex_attn`
    and `_supports_flash_attn` (what transformers itself checks before it builds a model with an implementation):
    a rename would make auto pick eager everywhere, silently slower."""
    from transformers import Gemma2ForCausalLM, LlamaForCausalLM

    from src.lm.hf import ATTENTION_SUPPORT

    for flag in set(ATTENTION_SUPPORT.values()):
        assert getattr(LlamaForCausalLM, flag, None) is True, f"transformers' {flag} is gone"
    assert Gemma2ForCausalLM._supports_sdpa is False  # the case auto exists for


def test_transformers_experts_expert_parallel_switch():
    """src/parallel/tensor/experts.py turns on `_is_expert_parallel` of transformers' experts modules when it splits them
    over the tensor ranks: without it the grouped kernels leave the skipped slots' rows uninitialised (garbage
    gradients, seen). transformers' own expert parallelism (`transformers.distributed.expert_parallel`) sets it."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    experts = MixtralExperts(MixtralConfig(hidden_size=8, intermediate_size=8, num_local_experts=2))
    assert experts._is_expert_parallel is False, "transformers' experts have no _is_expert_parallel switch"
    assert experts.num_experts == 2


def test_transformers_attention_implementation_of_a_built_model():
    """src/core/dropout.py key_module reads a user's transformers model's `config._attn_implementation` (what it
    was built with: sdpa, eager, flash_attention_2...) to key its attention dropout or refuse a kernel's own."""
    import transformers

    config = transformers.BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    model = transformers.BertModel(config, add_pooling_layer=False)
    assert model.config._attn_implementation in ("sdpa", "eager"), "PretrainedConfig._attn_implementation is gone"
