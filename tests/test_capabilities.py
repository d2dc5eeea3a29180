"""Strategies declare what they can do on one base (src/parallel/capabilities.py), and nothing else reads a
strategy's flags with a guessed default."""

from __future__ import annotations

import ast
import importlib
import inspect

from conftest import ROOT
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy

from src.parallel import capabilities
from src.parallel.capabilities import Capabilities
from src.parallel.deepspeed import DeepSpeedStrategy
from src.parallel.fsdp import FSDP2Strategy
from src.parallel.pipeline.strategy import PipelineStrategy
from src.parallel.tensor.strategy import TensorParallelStrategy

OURS = (FSDP2Strategy, DeepSpeedStrategy, TensorParallelStrategy, PipelineStrategy)


def strategy_classes() -> set[type]:
    """Every class defined under src/ that subclasses a Lightning strategy."""
    found = set()
    for path in (ROOT / "src").rglob("*.py"):
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
        found |= {c for _, c in inspect.getmembers(module, inspect.isclass) if issubclass(c, Strategy)}
    return {c for c in found if c.__module__.startswith("src.")}


def test_every_strategy_of_ours_declares_its_capabilities():
    assert strategy_classes() == set(OURS)  # a new one is added to OURS
    for cls in OURS:
        assert issubclass(cls, Capabilities) and issubclass(cls, Strategy)
        assert cls.__mro__.index(Capabilities) > cls.__mro__.index(Strategy)  # Lightning's attributes win


def test_lightnings_own_strategies_get_the_defaults_and_ours_their_own():
    for stock in (DDPStrategy(), SingleDeviceStrategy(device="cpu"), DDPStrategy):
        caps = capabilities.of(stock)
        assert (caps.meta_init, caps.parallelizes, caps.generation, caps.check_config) == (False, False, "alone", None)
    assert FSDP2Strategy().meta_init and capabilities.of(FSDP2Strategy()).materializes_shards
    assert capabilities.of(PipelineStrategy).check_config is not None and PipelineStrategy.generation is None
    # DeepSpeed: Lightning's zero_stage_3 property, not the default, and meta_init follows it
    for stage in (2, 3):
        ds = DeepSpeedStrategy(stage=stage)
        assert capabilities.of(ds).zero_stage_3 == capabilities.of(ds).meta_init == (stage == 3)
    assert capabilities.of(DeepSpeedStrategy).requires_cuda


def test_no_strategy_flag_is_read_with_a_guessed_default():
    """`getattr(strategy, "flag", default)` outside the base: a flag misspelt or undeclared reads as the default."""
    files = [*(ROOT / "src").rglob("*.py"), ROOT / "train.py", ROOT / "eval.py"]
    base = inspect.getsourcefile(capabilities)
    found = []
    for path in files:
        if str(path) == base:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and len(node.args) == 3:
                if "strategy" in ast.unparse(node.args[0]):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_a_strategy_that_owns_the_step_turns_lightnings_optimization_off():
    """LitModule.automatic_optimization reads the `own_loss` of the strategy it trains under: False under the
    pipeline (its own training_step runs the step), True under Lightning's own strategies and with no Trainer; a
    module that turned it off keeps it off."""
    import lightning as L

    from src.lm.models.gpt2_module import GPT2LitModule

    module = GPT2LitModule(vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_embd=8)
    assert module.automatic_optimization and PipelineStrategy.own_loss and not capabilities.of(DDPStrategy).own_loss
    for strategy, automatic in (("auto", True), (PipelineStrategy(), False)):
        module.trainer = L.Trainer(logger=False, enable_checkpointing=False, accelerator="cpu", strategy=strategy)
        assert module.automatic_optimization is automatic
    module.trainer = L.Trainer(logger=False, enable_checkpointing=False, accelerator="cpu")
    module.automatic_optimization = False
    assert module.automatic_optimization is False


def test_the_samplers_deal_the_data_over_the_mesh_the_trainers_strategy_declares():
    """No module global: the data mesh is the strategy's own (`data_mesh`, which OwnMesh sets in setup_environment),
    read from the trainer; a strategy without one (before setup, Lightning's own), or no trainer, deals the data over
    all ranks (here one process)."""
    from types import SimpleNamespace

    from src.parallel.samplers import data_parallel_group, rank_and_world

    class DataMesh:  # the data-parallel dim of a (2 data parallel x 2 tensor parallel) mesh, seen from global rank 3
        def get_local_rank(self) -> int:
            return 1

        def size(self) -> int:
            return 2

        def get_group(self) -> str:
            return "its data-parallel group"

    ours = TensorParallelStrategy()
    assert ours.data_mesh is None and rank_and_world(SimpleNamespace(strategy=ours)) == (0, 1)
    ours.data_mesh = DataMesh()
    trainer = SimpleNamespace(strategy=ours)
    assert rank_and_world(trainer) == (1, 2) and data_parallel_group(trainer) == "its data-parallel group"
    assert rank_and_world(SimpleNamespace(strategy=TensorParallelStrategy())) == (0, 1)  # one strategy's, not all
    for stock in (DDPStrategy(), SingleDeviceStrategy(device="cpu")):
        assert rank_and_world(SimpleNamespace(strategy=stock)) == (0, 1)
    assert rank_and_world(None) == (0, 1) and data_parallel_group(None) is None
