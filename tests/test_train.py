"""End to end, as a user runs it: train.py (1 and 2 processes), a multirun sweep, eval.py, TensorBoard content."""

from __future__ import annotations

import csv
import math
import os
import re
from pathlib import Path

import pytest
from conftest import FAST, event_file_pid, event_files, path_overrides, read_events, run_script

from tests.helpers.margins import within

# Under pytest-xdist these tests run on one worker: they share module fixtures (runs) that it makes once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("train")]


def run_dirs(log_dir: Path) -> list[Path]:
    return sorted(p for p in (log_dir / "train" / "runs").iterdir() if p.is_dir())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One default-experiment run shared by the tests below (only step limits and sizes changed)."""
    tmp = tmp_path_factory.mktemp("default_run")
    dirs = {"log_dir": tmp / "logs", "cache_dir": tmp / "cache"}
    proc = run_script("train.py", FAST + path_overrides(dirs))
    (run,) = run_dirs(dirs["log_dir"])
    return {"proc": proc, "run": run, "dirs": dirs}


def test_default_experiment_trains_and_writes_a_run_dir(trained):
    run = trained["run"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", run.name)  # timestamped Hydra output dir
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "config_resolved.yaml").is_file()
    assert "val/loss = " in trained["proc"].stdout + trained["proc"].stderr  # the optimized metric is reported


@pytest.mark.fresh
def test_the_console_shows_steps_and_no_library_noise(tmp_path):
    """The progress bar counts steps of max_steps (it read "Epoch 0/-2"), and four lines of Lightning/torch noise are
    gone: the litlogger tip, the `limit_*_batches=1.0` notices, bf16's model-summary warning, pytree's deprecation."""
    dirs = {"log_dir": tmp_path / "logs", "cache_dir": tmp_path / "cache"}
    proc = run_script(
        "train.py",
        path_overrides(dirs)
        + [
            "extras.print_config=false",
            "trainer.max_steps=3",
            "trainer.val_check_interval=3",
            "test=false",
            "trainer.num_sanity_val_steps=0",
            "trainer.limit_val_batches=2",
            "model.n_layer=1",
            "data.seq_len=32",
            "trainer.precision=bf16-mixed",
            "callbacks.generate_text=null",
        ],
    )
    out = proc.stdout + proc.stderr
    assert "Step 3/3" in proc.stdout and "/-2" not in out, proc.stdout[-2000:]
    for noise in ("litlogger", "was configured so", "not supported by the model summary", "LeafSpec"):
        assert noise not in out, noise


def test_tensorboard_has_what_a_user_looks_for(trained):
    ea = read_events(trained["run"] / "tensorboard")
    scalars = set(ea.Tags()["scalars"])
    for tag in [
        "train/loss",
        "train/ppl",
        "val/loss",
        "val/ppl",
        "lr-AdamW/decay",
        "lr-AdamW/no_decay",
        "train/device/items_per_sec",
        "train/device/peak_memory_mib",
        "test/loss",  # items = tokens
        "validate/device/items_per_sec",
        "test/device/items_per_sec",
    ]:
        assert tag in scalars, f"{tag} missing from TensorBoard; have {sorted(scalars)}"
    memory = [e.value for e in ea.Scalars("train/device/peak_memory_mib")]
    assert 100 < memory[0] <= memory[-1] < 24 * 1024  # peak RSS of rank 0 in MiB: a peak never goes down
    tensors = set(ea.Tags()["tensors"])
    assert any(t.startswith("samples/") for t in tensors), tensors  # generated text
    from tensorboard.plugins.hparams import plugin_data_pb2  # the HPARAMS tab: config values and metric columns

    content = ea.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["model/n_layer"].number_value == 2 and start.hparams["data/tokenizer"].string_value == "bytes"
    assert start.hparams["model/params_total"].number_value > 0
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {m.name.tag for m in experiment.metric_infos} >= {"val/loss", "test/loss"}
    val = [e.value for e in ea.Scalars("val/loss")]
    assert len(val) == 2 and val[1] < val[0] < 6.0  # ln(257) = 5.55 at random init: it learns
    lrs = [e.value for e in ea.Scalars("lr-AdamW/decay")]
    assert max(lrs) <= 1e-3 + 1e-12 and lrs[0] < lrs[-1]  # warm-up from ~0 towards the configured LR


def test_eval_reproduces_the_last_validation_loss(trained):
    ckpt = trained["run"] / "checkpoints" / "last.ckpt"
    same_val_set = "trainer.limit_val_batches=4"  # as in training (FAST)
    proc = run_script(
        "eval.py",
        [f"ckpt_path={ckpt}", "extras.print_config=false", same_val_set, "trainer.enable_progress_bar=false"]
        + path_overrides(trained["dirs"]),
    )
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("EVAL "))
    metrics = dict(kv.split("=") for kv in line[5:].split())
    last_val = read_events(trained["run"] / "tensorboard").Scalars("val/loss")[-1].value
    within(abs(float(metrics["val/loss"]) - last_val), 1e-5, "eval.py val/loss")
    assert "test/loss" in metrics and "test/ppl" in metrics


def test_eval_with_a_missing_checkpoint_is_a_clear_error(tmp_path, dirs):
    proc = run_script("eval.py", [f"ckpt_path={tmp_path}/missing.ckpt"] + path_overrides(dirs), check=False)
    assert proc.returncode != 0 and "missing.ckpt" in proc.stderr and "it does not exist" in proc.stderr


def test_optimized_metric_is_returned(tmp_path, dirs):
    """train() returns the configured metric, which is what Hydra sweepers optimize."""
    from test_configs import compose_cfg

    from train import train

    cfg = compose_cfg(
        FAST + path_overrides(dirs) + ["trainer.max_steps=10", "test=false", "optimized_metric=val/ppl", "logger=csv"],
        tmp=tmp_path,
    )
    value = train(cfg)
    (metrics,) = tmp_path.rglob("metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    ppl = [float(row["val/ppl"]) for row in rows if row.get("val/ppl")]
    loss = [float(row["val/loss"]) for row in rows if row.get("val/loss")]
    assert value == pytest.approx(ppl[-1], rel=1e-6), (value, ppl)  # the value it names, as last logged
    assert value == pytest.approx(math.exp(loss[-1]), rel=1e-5) and value != pytest.approx(loss[-1]), (value, loss)


@pytest.mark.fresh
def test_ddp_two_cpu_processes_one_run_dir_rank0_writes(dirs):
    # an inherited OMP_NUM_THREADS of twice the cores (a shell profile's), which Lightning's launcher leaves alone
    too_many = {"OMP_NUM_THREADS": str(2 * len(os.sched_getaffinity(0)))}
    proc = run_script(
        "train.py",
        FAST
        + path_overrides(dirs)
        + ["trainer=ddp", "model=gpt2", "callbacks.throughput.peak_flops=4e11"]
        + ["trainer.max_steps=10", "trainer.val_check_interval=5"],  # suite time: 20 steps prove no more
        env=too_many,
    )
    out = proc.stdout + proc.stderr
    (run,) = run_dirs(dirs["log_dir"])  # exactly one output dir: the child rank reused its parent's
    assert not (dirs["log_dir"] / "train" / "multiruns").exists()
    assert "MEMBER: 2/2" in out  # Lightning's banner from the second rank
    # each rank is capped to its share of the cores (CpuThreadsPerRank): oversubscription is 4-15x slower
    for rank in (0, 1):
        m = re.search(rf"\[rank {rank}\] pid \d+, torch threads: (\d+) \((\d+) cores / 2 local", out)
        assert m, f"rank {rank} did not report its threads:\n{out[-3000:]}"
        assert int(m.group(1)) * 2 <= max(2, int(m.group(2)))
    # TensorBoard is written by rank 0 only: every event file carries the launching process' pid
    files = event_files(run)
    assert files and {event_file_pid(f) for f in files} == {int(re.search(r"\[rank 0\] pid (\d+)", out).group(1))}
    assert (run / "checkpoints" / "last.ckpt").is_file()
    # console lines name their rank (conf/hydra/default.yaml), and the child rank logs to its own file
    assert "][rank 0][" in out and "][rank 1][" in out
    assert "][rank 1][" in (run / "train_rank1.log").read_text()
    scalars = read_events(run / "tensorboard").Tags()["scalars"]
    assert "train/items_per_sec" in scalars  # tokens/s over all ranks
    assert "train/device/mfu" in scalars  # callbacks.throughput.peak_flops set below
    assert len(list(run.rglob(".hydra"))) == 1  # child ranks do not write their own config copies


def test_multirun_sweep_has_one_subdir_per_job(dirs):
    run_script(
        "train.py",
        ["-m", "model.optimizer.lr=1e-3,3e-4"]
        + FAST
        + path_overrides(dirs)
        + ["trainer.max_steps=10", "test=false", "callbacks.generate_text=null"],
    )
    (sweep,) = (dirs["log_dir"] / "train" / "multiruns").iterdir()
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1"]
    for job, lr in zip(jobs, ["0.001", "0.0003"]):
        assert (sweep / job / "checkpoints" / "last.ckpt").is_file()
        assert f"model.optimizer.lr={lr}" in (sweep / job / ".hydra" / "overrides.yaml").read_text()
    assert not (dirs["log_dir"] / "train" / "runs").exists()


def test_lr_scaling_reaches_the_optimizer_and_tensorboard(dirs):
    """lr 1e-3 tuned at batch 4, trained at global batch 16: linear -> 4e-3 in the LR TensorBoard shows."""
    run_script(
        "train.py",
        FAST
        + path_overrides(dirs)
        + [
            "model.lr_scaling=linear",
            "model.base_batch_size=4",
            "data.global_batch_size=16",
            "model.scheduler=null",
            "trainer.max_steps=3",
            "trainer.val_check_interval=3",
            "trainer.log_every_n_steps=1",
            "test=false",
            "callbacks.generate_text=null",
        ],
    )
    (run,) = run_dirs(dirs["log_dir"])
    lrs = [e.value for e in read_events(run / "tensorboard").Scalars("lr-AdamW/decay")]
    assert len(lrs) >= 1 and all(lr == pytest.approx(4e-3) for lr in lrs)
