"""`python -m src.tools.new_experiment NAME` writes a model, a datamodule, their configs, an experiment and a test that
are green as written, in a copy of the template: the tests that read conf/ and src/ (configs, code map, layers), the
test it writes, and the parity check of the new experiment on 1 process and 2 ranks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import FULL_MATRIX_ONLY, ROOT

from src.tools import new_experiment

COPIED = ("src", "conf", "tests", "bench", "scripts", "docs", "train.py", "eval.py", "README.md", "pyproject.toml")


def template_copy(tmp_path):
    for name in COPIED:
        source, target = ROOT / name, tmp_path / name
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
        else:
            shutil.copy(source, target)
    return tmp_path


@FULL_MATRIX_ONLY  # suite time, 36 s: the worked example it copies stays proven (test_experiments.py's mlp_table on 2 ranks, test_configs.py's and test_code_map.py's user files)
@pytest.mark.slow
def test_the_files_it_writes_are_green_as_written(tmp_path):
    root = template_copy(tmp_path)
    assert new_experiment.main(["churn"], root=root) == 0
    assert (root / "src" / "models" / "churn.py").read_text().count("class ChurnLitModule(LitModule)") == 1
    # the copy's own fork server (tests/helpers/forkrun.py), which imports the copy's src/, not this session's
    env = {k: v for k, v in os.environ.items() if k != "FORKRUN_DIR"}
    tests = ["tests/test_churn.py", "tests/test_code_map.py", "tests/test_layers.py", "tests/test_configs.py"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "0", *tests, "tests/test_experiments.py",
         "-k", "churn or code_map or layers or partners"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    for test in (
        "test_churn.py::test_a_batch_of_the_data_goes_through_the_model",
        "test_experiments.py::test_the_experiment_trains_the_same_model_on_2_ranks[churn]",  # the parity check
        "test_configs.py::test_option_composes_and_instantiates[model=churn]",
        "test_configs.py::test_option_composes_and_instantiates[experiment=churn]",
        "test_code_map.py::test_the_readme_code_map_matches_the_tree",
    ):
        assert f"{test} PASSED" in proc.stdout, f"{test} did not pass:\n{proc.stdout[-4000:]}"


def test_a_name_it_cannot_use_is_one_sentence(tmp_path, capsys):
    assert new_experiment.main(["Churn-2"], root=tmp_path) == 2
    assert "cannot name the files" in capsys.readouterr().err
    assert new_experiment.main(["mlp"], root=tmp_path) == 2
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "churn.yaml").write_text("kept: true\n")
    assert new_experiment.main(["churn"], root=tmp_path) == 2
    assert "conf/model/churn.yaml exist already" in capsys.readouterr().err
    assert (tmp_path / "conf" / "model" / "churn.yaml").read_text() == "kept: true\n"  # nothing overwritten
    assert not (tmp_path / "src").exists()  # nothing written at all
