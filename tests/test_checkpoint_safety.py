"""A checkpoint is data (src/checkpoint/safe_load.py): a file someone else wrote never runs their code when it is
evaluated, resumed, started from or exported, in any of its forms; what it holds beyond the template's types, or a
stored `_target_` beyond what conf/ and src/ build, is one sentence and exit 2, unless trust_checkpoint=true.

Every payload would run: `__reduce__` returns `os.system("touch MARKER")`, and the test that opts in sees the marker.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import path_overrides, run_script
from test_errors import assert_one_clear_line, run_as_user
from test_parity import GPT2, QUIET

from src.checkpoint import safe_load
from src.checkpoint.convert import load_checkpoint, read_config
from src.checkpoint.resharding import form_of
from src.utils.errors import CheckpointError


class Payload:
    """Unpickled, it runs `touch marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def poisoned_dcp(src: Path, out: Path, marker: Path, where: str) -> Path:
    """A copy of the DCP dir `src` whose meta.pt, .metadata or one non-tensor shard item holds a Payload."""
    shutil.copytree(src, out)
    if where == "meta.pt":
        meta = torch.load(out / "meta.pt", weights_only=False)
        torch.save({**meta, "hyper_parameters": {"x": Payload(marker)}}, out / "meta.pt")
        return out
    metadata = pickle.loads((out / ".metadata").read_bytes())
    if where == ".metadata":
        metadata.planner_data = Payload(marker)
    else:  # a non-tensor item (an optimizer hyperparameter), which DCP's loader torch.loads with plain pickle
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        kinds = metadata.state_dict_metadata
        key = next(k for k in metadata.storage_data if isinstance(kinds[k.fqn], BytesStorageMetadata))
        info, item = metadata.storage_data[key], io.BytesIO()
        torch.save(Payload(marker), item)
        shard = out / info.relative_path
        info.offset, info.length = shard.stat().st_size, len(item.getvalue())
        with open(shard, "ab") as f:
            f.write(item.getvalue())
    (out / ".metadata").write_bytes(pickle.dumps(metadata))
    return out


@pytest.fixture
def small_dcp(tmp_path) -> Path:
    """A DCP dir as Lightning writes one (tensors and non-tensor items), in-process."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    state = {"state_dict": {"w": torch.ones(3)}, "optimizer_0": {"param_groups": [{"lr": 0.1, "params": ["w"]}]}}
    save(state, storage_writer=FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    torch.save({"global_step": 2}, tmp_path / "dcp" / "meta.pt")
    return tmp_path / "dcp"


# ---- the loader itself (one process, no run) ----


def test_a_file_holding_another_type_is_refused_naming_it_and_the_opt_in(tmp_path):
    marker = tmp_path / "MARKER"
    torch.save({"state_dict": {}, "hyper_parameters": {"x": Payload(marker)}}, tmp_path / "bad.ckpt")
    with pytest.raises(CheckpointError, match=r"holds a posix\.system.*trust_checkpoint=true") as refused:
        load_checkpoint(tmp_path / "bad.ckpt")
    assert "\n" not in str(refused.value) and not marker.exists()


@pytest.mark.parametrize("where", ["meta.pt", ".metadata", "shard item"])
def test_each_pickle_of_a_dcp_dir_is_read_as_data_before_torch_opens_it(tmp_path, small_dcp, where):
    marker = tmp_path / "MARKER"
    bad = poisoned_dcp(small_dcp, tmp_path / "bad", marker, where)
    for read in (load_checkpoint, form_of):  # eval / export / consolidate; every resume asks the form first
        with pytest.raises(CheckpointError, match=r"posix\.system"):
            read(bad)
    assert not marker.exists()
    assert form_of(small_dcp) == "dcp" and load_checkpoint(small_dcp)["global_step"] == 2  # the clean one reads


def test_trusting_loads_with_plain_pickle(tmp_path):
    """The opt-in is real: the payload runs (so the refusals above are of payloads that would)."""
    marker = tmp_path / "MARKER"
    torch.save({"state_dict": {}, "x": Payload(marker)}, tmp_path / "mine.ckpt")
    safe_load.trust(True)
    try:
        load_checkpoint(tmp_path / "mine.ckpt")
    finally:
        safe_load.trust(False)
    assert marker.exists()


def test_the_names_the_dcp_allowlist_holds_still_exist():
    """A torch upgrade that renames one would refuse every DCP dir that holds it: fail here first."""
    import importlib

    for module, name in safe_load.DCP_GLOBALS:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"


@pytest.mark.slow  # importing DeepSpeed takes ~10 s of one core
def test_the_names_the_deepspeed_allowlist_holds_still_exist():
    import importlib

    pytest.importorskip("deepspeed")
    for path in safe_load.DEEPSPEED:
        module, name = path.rsplit(".", 1)
        assert hasattr(importlib.import_module(module), name), path


def test_a_stored_target_outside_conf_and_src_is_refused_and_the_templates_own_pass():
    ok = {
        "model": {
            "_target_": "src.lm.models.gpt2_module.GPT2LitModule",
            "optimizer": {"_target_": "torch.optim.AdamW"},
        },
        "data": {"_target_": "src.lm.data.text.TextDataModule"},
    }
    safe_load.check_targets(ok, "ok.ckpt")
    for bad in ("os.system", "builtins.eval", "torch.load", "src.tools.checkpoints.main", "src.nosuch.Module"):
        with pytest.raises(CheckpointError, match=rf"_target_: '{bad}'.*trust_checkpoint=true"):
            safe_load.check_targets({**ok, "data": {"x": [{"_target_": bad}]}}, "bad.ckpt")


# ---- the entry points, on payloads built from one real run ----


@pytest.fixture(scope="module")
def payloads(tmp_path_factory) -> dict[str, Path]:
    """From one 2-step run: its last.ckpt with a pickled Payload (`pickle`), and with a stored data config whose
    `_target_` is os.system (`target`); `marker`: the file either would create."""
    tmp = tmp_path_factory.mktemp("payloads")
    dirs = {"log_dir": tmp / "logs", "cache_dir": tmp / "cache"}
    run_script(
        "train.py", QUIET + GPT2 + path_overrides(dirs) + ["trainer.max_steps=2", "trainer.val_check_interval=2"]
    )
    (run,) = (tmp / "logs" / "train" / "runs").iterdir()
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    marker = tmp / "MARKER"
    torch.save({**ckpt, "hyper_parameters": {"lr": Payload(marker)}}, tmp / "pickle.ckpt")
    config = {**ckpt["config"], "data": {"_target_": "os.system", "command": f"touch {marker}"}}
    torch.save({**ckpt, "config": config}, tmp / "target.ckpt")
    return {"pickle": tmp / "pickle.ckpt", "target": tmp / "target.ckpt", "marker": marker, "tmp": tmp}


def entry_point(how: str, ckpt: Path, tmp: Path) -> list[str]:
    quiet = ["extras.print_config=false", "trainer.enable_progress_bar=false", f"paths.log_dir={tmp / 'logs'}"]
    train = ["train.py"] + quiet + GPT2 + [f"paths.cache_dir={tmp / 'cache'}"]
    if how == "resume=auto":  # a last.ckpt planted in the run dir
        (tmp / "run" / "checkpoints").mkdir(parents=True)
        shutil.copy(ckpt, tmp / "run" / "checkpoints" / "last.ckpt")
        return train + ["resume=auto", f"hydra.run.dir={tmp / 'run'}"]
    return {
        "eval.py": ["eval.py", f"ckpt_path={ckpt}"] + quiet,
        "train.py ckpt_path=": train + [f"ckpt_path={ckpt}"],
        "model.pretrained=": train + [f"model.pretrained={ckpt}"],
        "export-hf": ["-m", "src.tools.checkpoints", "export-hf", str(ckpt), str(tmp / "hf")],
    }[how]


@pytest.mark.slow
@pytest.mark.parametrize(
    "payload,how",
    [
        ("pickle", "eval.py"),
        ("pickle", "train.py ckpt_path="),
        ("pickle", "resume=auto"),
        ("pickle", "model.pretrained="),
        ("pickle", "export-hf"),
        ("target", "eval.py"),
        ("target", "model.pretrained="),
        ("target", "export-hf"),
    ],
)
def test_every_entry_point_refuses_a_payload_in_one_line_and_runs_nothing(payloads, tmp_path, payload, how):
    rc, out, _ = run_as_user(entry_point(how, payloads[payload], tmp_path))
    opt_in = "--trust-checkpoint" if how == "export-hf" else "trust_checkpoint=true"
    assert_one_clear_line(rc, out, "posix.system" if payload == "pickle" else "_target_: 'os.system'", opt_in)
    assert not payloads["marker"].exists()


@pytest.mark.slow
def test_a_dcp_dir_from_a_real_fsdp2_run_is_refused_by_consolidate_and_eval(fsdp_checkpoint, tmp_path):
    marker = tmp_path / "MARKER"
    bad = poisoned_dcp(fsdp_checkpoint, tmp_path / "bad.ckpt", marker, ".metadata")
    rc, out, _ = run_as_user(["-m", "src.tools.checkpoints", "consolidate", str(bad), str(tmp_path / "out.ckpt")])
    assert_one_clear_line(rc, out, ".metadata holds a posix.system", "--trust-checkpoint")
    rc, out, _ = run_as_user(["eval.py", f"ckpt_path={bad}", f"paths.log_dir={tmp_path / 'logs'}"])
    assert_one_clear_line(rc, out, ".metadata holds a posix.system", "trust_checkpoint=true")
    assert not marker.exists() and read_config(fsdp_checkpoint)["model"]["_target_"]  # the real one reads


@pytest.mark.slow
def test_trust_checkpoint_true_is_threaded_to_every_load_of_eval(payloads, tmp_path):
    """The opt-in of conf/eval.yaml reaches the config read and Lightning's own load: the file evaluates, and its
    payload runs, as asked."""
    marker = tmp_path / "MARKER"
    ckpt = torch.load(payloads["pickle"], weights_only=False)
    torch.save({**ckpt, "hyper_parameters": {"lr": Payload(marker)}}, tmp_path / "mine.ckpt")
    args = ["trust_checkpoint=true", "extras.print_config=false", "trainer.enable_progress_bar=false"]
    proc = run_script("eval.py", [f"ckpt_path={tmp_path / 'mine.ckpt'}", f"paths.log_dir={tmp_path / 'logs'}"] + args)
    assert "EVAL " in proc.stdout and marker.exists()
