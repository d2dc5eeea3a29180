"""src/'s imports, read with ast: no import runs against the layer order, and no import circle.

The order, lowest first (README "Code map"): utils (errors, config, logging, labels, machine: imports nothing of
ours) < architectures (what is known of a model before it is built, GPT-2's adapter), launch (starting the ranks)
< checkpoint (saving, reading, resuming anywhere) < parallel (what makes N ranks train as 1) < core (the generic
floor: the base LightningModule and DataModule, keyed randomness, a plain datamodule's loaders; it knows no tokens,
objectives or experts) < lm (the language-model floor, built on core as a user's module is; inside it, lowest
first: its own root modules (hf.py, init.py: what it knows of transformers' models) < objectives, data (which know
nothing of each other) < features < models, callbacks (samples, lm-eval)) < models, datamodules (the user's rooms,
which know nothing of each other) < callbacks < tools < run (what a job does around the Trainer); train.py, eval.py and bench/ sit on top:
nothing in src/ imports bench/, bench/common.py (what the benches share) imports no bench, and the benches import
each other in no circle.
Function-level imports count too: they are how a circle hides.

UPWARD lists the imports that still run against the order, each a debt to pay by moving the code that needs it
up a layer (the run orchestration in src/run/job.py and checks.py belongs above parallel and tools). The test
fails on any other, and on an entry that no longer exists, so the list can only shrink.
"""

from __future__ import annotations

import ast
import re
import tokenize

import pytest
from conftest import ROOT

LAYER = {  # a package of src/ (`core`) or of src/lm/ (`lm.data`); `lm` is src/lm/'s own modules
    **{"utils": 0, "architectures": 1, "launch": 1, "checkpoint": 2, "parallel": 3, "core": 4},
    **{"lm": 5, "lm.objectives": 6, "lm.data": 6, "lm.features": 7, "lm.models": 8, "lm.callbacks": 8},
    **{"models": 9, "datamodules": 9, "callbacks": 10, "tools": 11, "run": 12},
}
UPWARD: set[tuple[str, str]] = set()  # (importing module, imported module): known debts; none left


def imports(top: str = "src") -> dict[str, set[str]]:
    """Each module of `top` (src, bench) -> the modules of `top` it imports (anywhere in the file)."""
    files = {
        ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): f
        for f in (ROOT / top).rglob("*.py")
    }
    graph = {}
    for module, path in files.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == top:
                # `from src.launch import launcher_env` names a module; `from src.x import name` the module x
                found |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module for a in node.names
                }
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] == top}
        graph[module] = {m for m in found if m in files and m != module}
    return graph


def package(module: str) -> str | None:
    """The LAYER key of a module of src/ (`src.lm.data.text` -> `lm.data`); None for src/'s own modules."""
    parts = module.split(".")
    if len(parts) > 3 and ".".join(parts[1:3]) in LAYER:
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 2 else None


def layer(module: str) -> int | None:
    return LAYER.get(package(module))


def test_no_import_runs_against_the_layer_order():
    graph = imports()
    upward = {
        (a, b)
        for a, edges in graph.items()
        for b in edges
        if layer(a) is not None
        and layer(b) is not None
        and (layer(b) > layer(a) or (layer(b) == layer(a) and package(a) != package(b)))
    }
    assert upward - UPWARD == set(), f"imports against the order {LAYER}: {sorted(upward - UPWARD)}"
    assert UPWARD - upward == set(), f"paid debts: remove {sorted(UPWARD - upward)} from UPWARD"


def test_every_package_has_a_layer():
    packages = {p.name for p in (ROOT / "src").iterdir() if (p / "__init__.py").is_file()}
    packages |= {f"lm.{p.name}" for p in (ROOT / "src" / "lm").iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(LAYER), f"give each package of src/ a layer: {sorted(packages ^ set(LAYER))}"


@pytest.mark.parametrize("top", ["src", "bench"])
def test_no_import_circle(top):
    graph = {a: edges - {b for x, b in UPWARD if x == a} for a, edges in imports(top).items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(graph[module]):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def bench_imports(path) -> set[str]:
    """The bench modules a file imports (anywhere in it)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "bench":
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "bench"}
    return found


def test_bench_sits_on_top():
    """src/ imports nothing of bench/ (train.py loads a bench's callback from its name in an override), and
    bench/common.py imports no bench: the benches import it, src/ and the ways they measure."""
    from_src = {str(f.relative_to(ROOT)): bench_imports(f) for f in (ROOT / "src").rglob("*.py")}
    assert {f: found for f, found in from_src.items() if found} == {}
    assert bench_imports(ROOT / "bench" / "common.py") == set()
    assert "bench.common" in {m for edges in imports("bench").values() for m in edges}  # the scan sees bench/


# what only the language model knows: its package, objectives, token data, experts, adapters (case-insensitive)
LM_WORDS = re.compile(
    r"src[./]lm\b|\bobjectives?\b|\btokeni[sz]er|\b(token_cache|corpus|LANGUAGE_KINDS)\b|\bexperts?\b|CausalLM|"
    r"\b(DPO|GRPO|peft|lora)\b",
    re.IGNORECASE,
)


def lm_mentions(folder, root=ROOT) -> list[str]:
    """Where a folder's modules import the LM package or name what only it knows (LM_WORDS), in code, strings,
    docstrings and comments alike."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.relative_to(root)}:{node.lineno}: imports {n}" for n in names if n.startswith("src.lm")]
        for number, line in enumerate(text.splitlines(), 1):
            found += [f"{path.relative_to(root)}:{number}: {m[0]}" for m in LM_WORDS.finditer(line)]
    return found


def test_the_core_knows_nothing_of_the_language_model():
    """src/core/ is the floor both the LM (src/lm/) and a user's module stand on: none of its modules imports the LM
    package or names its objectives, token data or experts (each such need is a hook the LM implements)."""
    assert lm_mentions(ROOT / "src" / "core") == []


def test_the_core_check_sees_a_mention(tmp_path):
    (tmp_path / "a.py").write_text("from src.lm.data import text\n\nX = 1  # the DPO sums\n")
    assert lm_mentions(tmp_path, root=tmp_path) == ["a.py:1: imports src.lm.data", "a.py:1: src.lm", "a.py:3: DPO"]


def test_the_layer_test_sees_an_upward_import(tmp_path, monkeypatch):
    """The check bites: a utils module importing an objective's module is reported."""
    import test_layers

    fake = tmp_path / "src" / "utils"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("from src.lm.objectives.loss import IGNORE_INDEX\n")
    (tmp_path / "src" / "lm" / "objectives").mkdir(parents=True)
    (tmp_path / "src" / "lm" / "objectives" / "loss.py").write_text("IGNORE_INDEX = -100\n")
    monkeypatch.setattr(test_layers, "ROOT", tmp_path)
    monkeypatch.setattr(test_layers, "UPWARD", set())
    try:
        test_layers.test_no_import_runs_against_the_layer_order()
    except AssertionError as e:
        assert "('src.utils.bad', 'src.lm.objectives.loss')" in str(e)
    else:
        raise AssertionError("an upward import went unseen")


OBJECTIVES = ["base", "sft", "dpo", "reward", "grpo"]  # src/lm/objectives/: the objectives and their base


def test_objectives_use_only_the_trained_modules_contract():
    """Every `module.<name>` an objective reads is a member of TrainedModule (src/lm/objectives/base.py), none is
    private, and CausalLMLitModule has each: the contract between the module and its objectives is that class."""
    # every objective of conf/model/objective/ is scanned
    assert sorted(OBJECTIVES[1:]) == sorted(p.stem for p in (ROOT / "conf" / "model" / "objective").glob("*.yaml"))
    from src.lm.models.gpt2_module import GPT2LitModule
    from src.lm.objectives.base import TrainedModule

    contract = set(TrainedModule.__annotations__) | {n for n in vars(TrainedModule) if not n.startswith("_")}
    used: dict[str, set[str]] = {}
    for name in OBJECTIVES:
        tree = ast.parse((ROOT / "src" / "lm" / "objectives" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "module":
                used.setdefault(node.attr, set()).add(name)
    assert used, "no objective reads its module: the scan is broken"
    outside = {attr: files for attr, files in used.items() if attr not in contract}
    assert not outside, f"objectives read members outside TrainedModule: {outside}"
    module = GPT2LitModule(vocab_size=64, seq_len=16, n_layer=1, n_head=2, n_embd=8)
    missing = [m for m in contract if m not in ("trainer",) and not hasattr(module, m)]
    assert not missing, f"CausalLMLitModule lacks {missing}"


def test_an_objective_a_strategy_computes_gives_its_own_loss_and_metrics_through_it():
    """A strategy that computes the loss itself (own_loss: the pipeline's last stage) asks the objective for each
    micro-batch's `loss_sum` (from the logits and labels), the batch's `n_targets` and `add_sums` for evaluation: for
    an objective that runs there, on a batch cut into two micro-batches (-100 labels included), they give its own
    training loss and evaluation metrics; an objective refused there (`refused_under`) has none of the three."""
    import lightning as L
    import torch
    from hydra.utils import get_object
    from omegaconf import OmegaConf

    from src.lm.models.gpt2_module import GPT2LitModule
    from src.lm.objectives.base import Objective

    asked = ("loss_sum", "n_targets", "add_sums")
    classes = [
        get_object(OmegaConf.load(ROOT / "conf" / "model" / "objective" / f"{name}.yaml")._target_)
        for name in OBJECTIVES[1:]
    ]
    runs = [c for c in classes if "own_loss" not in c.refused_under]
    assert runs, "no objective runs under a strategy that computes its loss: the check is empty"
    for cls in classes:
        overridden = [m for m in asked if getattr(cls, m) is not getattr(Objective, m)]
        assert overridden == (list(asked) if cls in runs else []), f"{cls.__name__} gives {overridden} of {asked}"
    for cls in runs:
        torch.manual_seed(0)
        module = GPT2LitModule(vocab_size=64, seq_len=16, n_layer=1, n_head=2, n_embd=8, objective=cls())
        module.trainer = L.Trainer(logger=False, enable_checkpointing=False, log_every_n_steps=1000, accelerator="cpu")
        ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
        labels = torch.cat([ids[:, 1:], torch.full((4, 1), -100)], 1)
        labels[1, :9] = -100  # a prompt's labels
        batch = {"input_ids": ids, "labels": labels}
        objective = module.objective
        with torch.no_grad():
            own = module.training_step(batch, 0)  # no step table: the batch's own mean
            logits = module.lm_forward(batch).logits
            sums = [objective.loss_sum(module, logits[i : i + 2], labels[i : i + 2]) for i in (0, 2)]
            asked_loss = sum(sums) / objective.n_targets(batch)
            objective.evaluation_step(module, batch, objective.val_metrics)
            objective.add_sums(objective.test_metrics, sum(sums), objective.n_targets(batch))
        assert int(objective.n_targets(batch)) == 4 * 15 - 9
        torch.testing.assert_close(asked_loss, own)
        evaluated = objective.epoch_metrics("x", objective.val_metrics)
        assert evaluated
        torch.testing.assert_close(objective.epoch_metrics("x", objective.test_metrics), evaluated)


STRATEGY_CLASS = re.compile(r"\b[A-Z]\w*Strategy\b")  # DDPStrategy, PipelineStrategy, FSDP2Strategy, ...


def strategy_names(path, root=ROOT) -> list[str]:
    """The strategy class names a file's code and strings (docstrings included) hold, comments left out."""
    found = []
    with open(path) as f:
        for token in tokenize.generate_tokens(f.readline):
            if token.type in (tokenize.NAME, tokenize.STRING) and STRATEGY_CLASS.search(token.string):
                found.append(f"{path.relative_to(root)}:{token.start[0]}: {STRATEGY_CLASS.search(token.string)[0]}")
    return found


def test_no_strategy_class_is_named_outside_src_parallel():
    """What a strategy does is asked of its capabilities (src/parallel/capabilities.py `of`), never of its class:
    no class name (in code, an isinstance, a table keyed by names, or a docstring) outside src/parallel/."""
    files = [p for p in (ROOT / "src").rglob("*.py") if "parallel" not in p.relative_to(ROOT / "src").parts[:1]]
    found = [hit for path in [*files, ROOT / "train.py", ROOT / "eval.py"] for hit in strategy_names(path)]
    assert found == [], "ask capabilities.of(strategy) instead: " + "; ".join(found)


def test_the_strategy_name_check_sees_one(tmp_path):
    (tmp_path / "x.py").write_text(
        "import a\n\nok = isinstance(s, a.DeepSpeedStrategy)  # FSDP2Strategy in a comment\n"
    )
    assert strategy_names(tmp_path / "x.py", root=tmp_path) == ["x.py:3: DeepSpeedStrategy"]


def long_functions(folder, limit: int, root=ROOT) -> list[str]:
    """The functions (methods included) of a folder's modules longer than `limit` lines, signature to last line."""
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            length = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and length > limit:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.name} ({length} lines)")
    return found


def test_the_lm_module_is_a_short_composition():
    """The LM module composes a model spec, an objective and features that each own their option, probe and refusals
    (src/lm/models/causal_lm.py's docstring): it stays under 300 lines, no function of the folders src/models/ was once
    (the LM's models and features, the core, the user's models) runs over 60, and only src/core/probe.py switches a
    module's mode for a probe (`probing`: restored whatever happens)."""
    src = ROOT / "src"
    folders = [src / "lm" / "models", src / "lm" / "features", src / "lm", src / "core", src / "models"]
    assert len((src / "lm" / "models" / "causal_lm.py").read_text().splitlines()) < 300, "move a feature out"
    assert [hit for folder in folders for hit in long_functions(folder, 60)] == []
    toggles = [
        p.name
        for folder in folders
        for p in folder.glob("*.py")
        if "was_training" in p.read_text() and p != src / "core" / "probe.py"
    ]
    assert toggles == [], f"probe with src/core/probe.py's probing(module) instead: {toggles}"


def test_the_length_check_sees_a_long_function(tmp_path):
    (tmp_path / "x.py").write_text("def f():\n" + "    x = 1\n" * 60 + "\n\ndef g():\n    return 1\n")
    assert long_functions(tmp_path, 60, root=tmp_path) == ["x.py:1: f (61 lines)"]


def test_no_package_over_15_modules_and_no_function_over_60_lines():
    """The house's size rules, everywhere in src/ and the root scripts: a package holds at most 15 modules (a room a
    newcomer reads whole; more is two rooms), and no function runs over 60 lines."""
    packages = {p.parent for p in (ROOT / "src").rglob("__init__.py")}
    crowded = {
        str(p.relative_to(ROOT)): n for p in packages if (n := len(set(p.glob("*.py")) - {p / "__init__.py"})) > 15
    }
    assert crowded == {}, f"split these into sub-packages named for what they hold: {crowded}"
    long = [hit for folder in sorted(packages) + [ROOT] for hit in long_functions(folder, 60)]
    assert long == [], f"split these functions: {long}"
