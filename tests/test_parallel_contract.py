"""src/parallel asks the model it splits only what src/parallel/contract.py declares (`ParallelLM`, and of its
objective `StageObjective`) beside LitModule's own interface: every `module.<name>` (and `getattr(module, "<name>")`)
src/parallel reads, read with ast, that is a member of the LM module but not of LitModule is one of the Protocol's.
The LM module implements the Protocol, and a model that does not is refused before any rank starts."""

from __future__ import annotations

import ast

import pytest
from conftest import ROOT
from hydra.utils import get_object
from omegaconf import OmegaConf
from torch import nn

from src.parallel import contract
from src.utils.config import ConfigError

MODULE = {"module", "lm", "pl_module", "lightning_module"}  # what src/parallel calls the LightningModule it splits


def members(protocol: type) -> set[str]:
    return set(protocol.__annotations__) | {n for n in vars(protocol) if not n.startswith("_")}


def tiny_lm() -> nn.Module:
    """A 1-layer GPT-2 built from conf/model/gpt2.yaml's `_target_` (the LM module wherever it lives)."""
    cls = get_object(OmegaConf.load(ROOT / "conf" / "model" / "gpt2.yaml")._target_)
    return cls(vocab_size=64, seq_len=16, n_layer=1, n_head=2, n_embd=8)


def lm_names() -> tuple[set[str], set[str]]:
    """(the LM module's public members that LitModule lacks, its objective's that nn.Module lacks), the Protocols'
    own left out: the names src/parallel may not read."""
    module = tiny_lm()
    lit = next(c for c in type(module).__mro__ if c.__name__ == "LitModule")
    plain = lit(None, None, 0.0, "none", 1)  # LitModule's own instance: what its __init__ and nn.Module's set
    of_module = {n for n in set(dir(module)) | set(vars(module)) if not n.startswith("_")} - set(dir(plain))
    of_objective = {n for n in dir(module.objective) if not n.startswith("_")} - set(dir(nn.Module))
    return of_module - members(contract.ParallelLM), of_objective - members(contract.StageObjective)


def receiver(node: ast.AST) -> str | None:
    """'module' for the LightningModule (a name of MODULE, or `<x>.lightning_module`), 'objective' for its
    objective, else None."""
    if isinstance(node, ast.Name) and node.id in MODULE or isinstance(node, ast.Attribute) and node.attr in MODULE:
        return "module"
    if (
        isinstance(node, ast.Name)
        and node.id == "objective"
        or isinstance(node, ast.Attribute)
        and node.attr == "objective"
    ):
        return "objective"
    return None


def reads(folder, root=ROOT) -> list[tuple[str, str, str]]:
    """(file:line, 'module' or 'objective', name) of every member src/parallel reads of the module or its objective,
    the Protocols' own module left out."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        if path.name == "contract.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and receiver(node.value):
                found.append((f"{path.relative_to(root)}:{node.lineno}", receiver(node.value), node.attr))
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr") and len(node.args) > 1:
                name = node.args[1]
                if receiver(node.args[0]) and isinstance(name, ast.Constant) and isinstance(name.value, str):
                    found.append((f"{path.relative_to(root)}:{node.lineno}", receiver(node.args[0]), name.value))
    return found


def outside(found: list[tuple[str, str, str]], names: tuple[set[str], set[str]]) -> list[str]:
    of_module, of_objective = names
    return [
        f"{where}: {kind}.{name}"
        for where, kind, name in found
        if name in (of_module if kind == "module" else of_objective)
    ]


def test_src_parallel_reads_of_the_model_only_what_the_protocol_declares():
    found = reads(ROOT / "src" / "parallel")
    assert {kind for _, kind, _ in found} == {"module", "objective"}, "the scan sees no use: it is broken"
    names = lm_names()
    assert {"config", "spec", "model"} <= names[0] and "training_step" in names[1]  # the sets are the LM's
    assert outside(found, names) == [], "declare it in src/parallel/contract.py's ParallelLM, or ask LitModule"


def test_the_protocol_check_sees_an_lm_attribute(tmp_path):
    (tmp_path / "x.py").write_text(
        "def f(module, strategy):\n    a = strategy.lightning_module.config\n    b = getattr(module, 'spec', None)\n"
        "    c = module.hf_model.config\n    return module.objective.loss_sum, module.objective.training_step\n"
    )
    assert outside(reads(tmp_path, root=tmp_path), lm_names()) == [
        "x.py:2: module.config",
        "x.py:3: module.spec",
        "x.py:5: objective.training_step",
    ]


def test_the_lm_module_implements_the_protocol_and_another_model_is_refused_before_any_rank_starts():
    module = tiny_lm()
    assert isinstance(module, contract.ParallelLM) and isinstance(module.objective, contract.StageObjective)
    conf = ROOT / "conf" / "model"
    assert contract.implemented_by(OmegaConf.load(conf / "gpt2.yaml"))
    assert not contract.implemented_by(OmegaConf.load(conf / "convnet.yaml"))
    from src.parallel.pipeline import schedule
    from src.parallel.tensor import strategy

    splits = {"pipeline_parallel_size": 2, "schedule": "GPipe", "n_microbatches": 4, "stages_per_rank": 1}
    cfg = OmegaConf.create({"model": OmegaConf.load(conf / "gpt2.yaml"), "trainer": {"devices": 2}})
    cfg.trainer.strategy = {**splits, "tensor_parallel_size": 2}
    cfg.model._target_ = OmegaConf.load(conf / "mlp.yaml")._target_  # a LitModule; its config reads as GPT-2's
    for check, option in ((strategy.check_config, "tp"), (schedule.check_config, "pipeline")):
        with pytest.raises(ConfigError, match=f"trainer={option} splits transformers decoder LMs only"):
            check(cfg)
