"""Start a model of your own: python -m src.tools.new_experiment NAME

Writes, from the worked example of docs/your-model.md (the table classifier), files named for NAME:

    src/models/NAME.py          NAMELitModule (LitModule): an MLP with BatchNorm and dropout
    src/datamodules/NAME.py     NAMEDataModule (ShardedDataModule): a bundled scikit-learn table or your CSV
    conf/model/NAME.yaml, conf/data/NAME.yaml, conf/experiment/NAME.yaml
    tests/test_NAME.py          its first test: the data's batch through the model

Each is green as written: `make test` composes the new options, runs this test and proves the experiment on 1
process and 2 ranks (tests/test_experiments.py). Then make them yours, and keep `python -m src.tools.parity
experiment=NAME trainer=ddp` passing. Refuses (exit 2) a NAME that is not a Python identifier or whose files exist.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = {"model": "mlp", "data": "table"}  # the worked example's option names


def camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def renamed(text: str, name: str) -> str:
    """The example's text with its names made NAME's: classes, modules, config targets and options."""
    text = text.replace("MLPLitModule", f"{camel(name)}LitModule").replace(
        "TableDataModule", f"{camel(name)}DataModule"
    )
    text = re.sub(r"\bsrc\.models\.mlp\b", f"src.models.{name}", text)
    text = re.sub(r"\bsrc\.datamodules\.table\b", f"src.datamodules.{name}", text)
    text = re.sub(r"src/models/mlp\.py", f"src/models/{name}.py", text)
    text = re.sub(r"src/datamodules/table\.py", f"src/datamodules/{name}.py", text)
    text = text.replace("override /data: table", f"override /data: {name}").replace(
        "override /model: mlp", f"override /model: {name}"
    )
    text = text.replace("experiment=mlp_table", f"experiment={name}").replace("(data=table)", f"(data={name})")
    text = text.replace(
        "The worked example of docs/your-model.md", "Started from the worked example of docs/your-model.md"
    )
    return text.replace("tags: [mlp, table]", f"tags: [{name}]")


TEST = '''"""{name}: the first test of the files `python -m src.tools.new_experiment {name}` wrote. tests/test_experiments.py
proves the experiment on 1 process and 2 ranks; add here what your model must do."""

import torch
from conftest import ROOT
from hydra.utils import instantiate
from omegaconf import OmegaConf

from src.datamodules.{name} import {Camel}DataModule


def test_a_batch_of_the_data_goes_through_the_model():
    datamodule = {Camel}DataModule(global_batch_size=8)
    datamodule.setup("fit")
    model = instantiate(OmegaConf.load(ROOT / "conf/model/{name}.yaml"), **datamodule.model_kwargs)
    x, y = next(iter(datamodule.val_dataloader()))
    logits = model.eval()(x)
    assert logits.shape == (len(y), datamodule.model_kwargs["num_classes"])
    assert torch.isfinite(logits).all()
'''


def files(name: str) -> dict[Path, str]:
    read = lambda path: (ROOT / path).read_text()  # noqa: E731
    return {
        Path(f"src/models/{name}.py"): renamed(read("src/models/mlp.py"), name),
        Path(f"src/datamodules/{name}.py"): renamed(read("src/datamodules/table.py"), name),
        Path(f"conf/model/{name}.yaml"): renamed(read("conf/model/mlp.yaml"), name),
        Path(f"conf/data/{name}.yaml"): renamed(read("conf/data/table.yaml"), name),
        Path(f"conf/experiment/{name}.yaml"): renamed(read("conf/experiment/mlp_table.yaml"), name),
        Path(f"tests/test_{name}.py"): TEST.format(name=name, Camel=camel(name)),
    }


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="lowercase, a Python identifier: names the modules, classes and options")
    name = parser.parse_args(argv).name
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name in (*EXAMPLE.values(), "base"):
        print(f"error: {name!r} cannot name the files: use lowercase letters, digits and _ (not mlp, table or base).",
              file=sys.stderr)  # fmt: skip
        return 2
    written = files(name)
    taken = [str(path) for path in written if (root / path).exists()]
    if taken:
        print(f"error: {', '.join(taken)} exist already: choose another name, or remove them.", file=sys.stderr)
        return 2
    for path, text in written.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
        print(f"wrote {path}")
    print(f"next: python train.py experiment={name}; python -m src.tools.parity experiment={name} trainer=ddp")
    return 0


if __name__ == "__main__":
    sys.exit(main())
