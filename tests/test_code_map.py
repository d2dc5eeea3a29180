"""README's code map names every module of each folder it lists, and every package of src/ and bench/: it cannot
drift from the tree again (it had: three checkpoint modules went unlisted for several stops).

One exception, for the users who clone the template and add their own model or datamodule (src/models/<name>.py,
src/datamodules/<name>.py, built by their conf/model/<name>.yaml, conf/data/<name>.yaml and an experiment): adding
one must not turn `make test` red by itself. An unlisted module of those two folders (PLUGIN_FOLDERS) passes when
nothing of the template reaches it:
- no module of src/ or bench/, nor train.py or eval.py, imports it (imports by other such unlisted modules aside: a
  user's model may have a helper module of its own), and
- no option that README's Configuration table names (`convnet`, `digits`, ...) has it as its `_target_`.
Each template module of those folders is reached one of these two ways (its code imports it, or the README documents
the option that builds it: convnet.py, images.py), so leaving one out of the map still fails; anywhere else every
module must be listed. test_the_check_sees_a_module_left_out proves both.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import yaml
from conftest import ROOT

PLUGIN_FOLDERS = ("src/models/", "src/datamodules/")


def code_map(text: str) -> dict[str, str]:
    """The code map's entries: a path at the start of a line -> its words (continuation lines are indented)."""
    block = text.split("## Code map", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    path = None
    for line in block.splitlines():
        if line and not line[0].isspace():
            path, _, words = line.partition(" ")
            entries[path] = words
        elif path is not None:
            entries[path] += " " + line.strip()
    return entries


def importers(root: Path) -> dict[str, set[str]]:
    """Each module name the template's code imports (`src.lm.hf`) -> the modules that import it, read with ast
    from src/, bench/, train.py and eval.py (function-level imports too)."""
    found: dict[str, set[str]] = {}
    for path in [*(root / "src").rglob("*.py"), *(root / "bench").rglob("*.py"), root / "train.py", root / "eval.py"]:
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:  # `from src.models import hf` names src.lm.hf
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                found.setdefault(name, set()).add(module)
    return found


def documented_targets(root: Path) -> set[str]:
    """The modules that build the options README's Configuration table names: for each row's group (`model`) and
    each option in backticks on that row (`convnet`), the module of conf/<group>/<option>.yaml's `_target_`."""
    table = (root / "README.md").read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    modules = set()
    for row in table.splitlines():
        cells = row.split("|")
        if len(cells) < 4:
            continue
        for group in re.findall(r"`([\w/]+)`", cells[1]):
            for option in re.findall(r"`(\w+)`", "".join(cells[2:])):
                path = root / "conf" / group / f"{option}.yaml"
                target = (yaml.safe_load(path.read_text()) or {}).get("_target_") if path.is_file() else None
                if isinstance(target, str):
                    modules.add(target.rsplit(".", 1)[0])
    return modules


def users_own(root: Path, unlisted: set[str]) -> set[str]:
    """The unlisted plug-in modules (`src.models.mlp`) that nothing of the template reaches: see the docstring."""
    imported, documented = importers(root), documented_targets(root)
    own = {m for m in unlisted if m not in documented}
    while True:  # a module imported by one that is not the user's own is not theirs either
        keep = {m for m in own if imported.get(m, set()) - {m} <= own}
        if keep == own:
            return own
        own = keep


def check(entries: dict[str, str], root: Path = ROOT) -> list[str]:
    """What the map gets wrong: a folder's modules it leaves out (but a user's own model or datamodule) or names
    wrongly, a package of src/ or bench/ it lacks."""
    wrong = []
    for path, words in entries.items():
        folder = root / path
        if not path.startswith(("src/", "bench/")) or not folder.is_dir():  # tests/, conf/: described, not listed
            continue
        named = set(re.findall(r"\b(\w+\.py)\b", words))
        present = {f.name for f in folder.glob("*.py") if f.name != "__init__.py"}
        unlisted = present - named
        if path in PLUGIN_FOLDERS:
            module = path.strip("/").replace("/", ".")
            own = users_own(root, {f"{module}.{name.removesuffix('.py')}" for name in unlisted})
            unlisted -= {f"{m.rsplit('.', 1)[1]}.py" for m in own}
        if unlisted or named - present:
            wrong.append(f"{path}: unlisted {sorted(unlisted)}, not in the folder {sorted(named - present)}")
    packages = {
        f"{top}/{p.name}/" for top in ("src", "bench") for p in (root / top).iterdir() if (p / "__init__.py").is_file()
    }
    wrong += [f"{p}: no line in the code map" for p in sorted(packages - set(entries))]
    return wrong


def test_the_readme_code_map_matches_the_tree():
    assert check(code_map((ROOT / "README.md").read_text())) == []


def test_the_check_sees_a_module_left_out():
    """Anywhere (modules the template's code imports: hf.py, datamodule.py, prompts.py), and in the plug-in folders
    too: the ones only an option the README documents builds (convnet.py: model=convnet; images.py: data=digits,
    mnist). A plug-in module the template's code imports: test_a_users_model_and_datamodule_do_not_fail_the_check."""
    entries = code_map((ROOT / "README.md").read_text())
    entries["src/parallel/tensor/"] = entries["src/parallel/tensor/"].replace("experts.py", "")
    del entries["src/launch/"]
    entries["bench/scale/"] = entries["bench/scale/"].replace("comm.py", "")
    del entries["bench/suite/"]
    entries["src/core/"] = entries["src/core/"].replace("datamodule.py", "")
    entries["src/lm/"] = entries["src/lm/"].replace("hf.py", "")
    entries["src/lm/data/"] = entries["src/lm/data/"].replace("prompts.py", "")
    entries["src/models/"] = entries["src/models/"].replace("convnet.py", "")
    entries["src/datamodules/"] = entries["src/datamodules/"].replace("images.py", "")
    assert check(entries) == [
        "src/parallel/tensor/: unlisted ['experts.py'], not in the folder []",
        "src/core/: unlisted ['datamodule.py'], not in the folder []",
        "src/lm/: unlisted ['hf.py'], not in the folder []",
        "src/lm/data/: unlisted ['prompts.py'], not in the folder []",
        "src/models/: unlisted ['convnet.py'], not in the folder []",
        "src/datamodules/: unlisted ['images.py'], not in the folder []",
        "bench/scale/: unlisted ['comm.py'], not in the folder []",
        "bench/suite/: no line in the code map",
        "src/launch/: no line in the code map",
    ]


USER_FILES = {  # a user's addition: a tiny MLP on a scikit-learn table, its helper, its data, their conf
    "src/models/ranker.py": "from src.core.module import LitModule\nfrom src.models.ranker_blocks import block\n\n\n"
    "class RankerLitModule(LitModule):\n    pass\n",
    "src/models/ranker_blocks.py": "from torch import nn\n\n\ndef block(n_in, n_out):\n    return nn.Linear(n_in, n_out)\n",
    "src/datamodules/ledger.py": "from src.core.datamodule import ShardedDataModule\n\n\n"
    "class LedgerDataModule(ShardedDataModule):\n    pass\n",
    "conf/model/ranker.yaml": "_target_: src.models.ranker.RankerLitModule\n",
    "conf/data/ledger.yaml": "_target_: src.datamodules.ledger.LedgerDataModule\n",
    "conf/experiment/ranker_ledger.yaml": "# @package _global_\ndefaults:\n  - override /data: ledger\n"
    "  - override /model: ranker\n",
}


def test_a_users_model_and_datamodule_do_not_fail_the_check(tmp_path):
    """In a copy of the tree, a user's files added and the README untouched: the check says what it said before.
    Once the template's own code imports the user's module, or the README's Configuration ledger names its option,
    it must be listed like any other."""
    ignore = shutil.ignore_patterns("__pycache__")
    for name in ("src", "bench", "conf"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=ignore)
    for name in ("train.py", "eval.py", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    readme = (tmp_path / "README.md").read_text()
    before = check(code_map(readme), root=tmp_path)  # [] in the template (the test above)
    for name, text in USER_FILES.items():
        (tmp_path / name).write_text(text)
    assert check(code_map(readme), root=tmp_path) == before

    def added() -> list[str]:
        return [line for line in check(code_map(readme), root=tmp_path) if line not in before]

    (tmp_path / "README.md").write_text(
        readme.replace("`sequence_classifier` |", "`sequence_classifier`, `ranker` |", 1)
    )
    assert added() == ["src/models/: unlisted ['ranker.py', 'ranker_blocks.py'], not in the folder []"]
    (tmp_path / "README.md").write_text(readme)
    (tmp_path / "train.py").write_text((ROOT / "train.py").read_text() + "\nimport src.datamodules.ledger  # noqa\n")
    assert added() == ["src/datamodules/: unlisted ['ledger.py'], not in the folder []"]
