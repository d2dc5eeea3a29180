"""From 1 device to N changes nothing but speed: equal numbers, not just "it runs".

Each test trains through train.py as a real subprocess (Lightning's DDP launcher on gloo for the
multi-process runs) and compares final parameters and the metrics logged to TensorBoard.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import FULL_MATRIX_ONLY, path_overrides, read_events, run_script

from tests.helpers.margins import within

pytestmark = pytest.mark.slow

# fp32: parity is exact there (1e-5), while bf16 rounding depends on each rank's micro-batch shape.
# The default precision is hardware-dependent (bf16-mixed on this CPU); test_train runs it.
QUIET = [
    "extras.print_config=false",
    "trainer.enable_progress_bar=false",
    "trainer.num_sanity_val_steps=0",
    "callbacks.generate_text=null",
    "callbacks.throughput=null",
    "trainer.log_every_n_steps=1",
    "trainer.precision=32-true",
]


def train(tmp: Path, name: str, args: list[str]) -> dict:
    dirs = {"log_dir": tmp / name, "cache_dir": tmp / "cache"}
    run_script("train.py", QUIET + path_overrides(dirs) + args)
    (run,) = (dirs["log_dir"] / "train" / "runs").iterdir()
    state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    ea = read_events(run / "tensorboard")
    scalars = {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}
    return {"params": state, "scalars": scalars}


def max_param_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


def assert_same_series(a: dict, b: dict, tag: str, tol: float) -> None:
    steps_a, vals_a = zip(*a["scalars"][tag])
    steps_b, vals_b = zip(*b["scalars"][tag])
    assert steps_a == steps_b, tag
    within(max(abs(x - y) for x, y in zip(vals_a, vals_b)), tol, tag)


GPT2 = [
    "data.path=" + str(Path(__file__).parent / "data" / "tiny_corpus.txt"),
    "data.seq_len=32",
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "data.global_batch_size=8",
    "trainer.max_steps=6",
    "trainer.val_check_interval=6",
    "test=false",
    "model.scheduler.num_warmup_steps=2",
]
# The 2-rank DDP run that test_fsdp and test_deepspeed compare against too: the `reference` fixture trains it once.
GPT2_DDP = GPT2 + ["trainer=ddp", "trainer.devices=2"]


def test_global_batch_1x8_equals_2x4_equals_1x4_accumulate_2(tmp_path, reference):
    """Same global batch, same samples, same updates: 1 process x 8, 2 processes x 4, 1 x 4 x accumulation 2."""
    one = train(tmp_path, "1x8", GPT2)
    two = reference(GPT2_DDP)
    acc = train(tmp_path, "1x4x2", GPT2 + ["trainer.accumulate_grad_batches=2"])
    within(max_param_diff(one["params"], two["params"]), 1e-5, "params")
    within(max_param_diff(one["params"], acc["params"]), 1e-5, "params")
    # the logged train loss is the global batch's (mean over ranks and micro-batches), at every step
    assert_same_series(one, two, "train/loss", 1e-5)
    assert_same_series(one, acc, "train/loss", 1e-5)
    assert_same_series(one, two, "val/loss", 1e-5)
    assert len(one["scalars"]["train/loss"]) == 6


VISION = [
    "data=digits",
    "model=convnet",
    "data.global_batch_size=12",
    "trainer.max_steps=5",
    "trainer.val_check_interval=5",
    "callbacks.model_checkpoint.monitor=val/acc",
    "callbacks.model_checkpoint.mode=max",
    "optimized_metric=val/acc",
]
# 1-process convnet references, each shared (`reference` fixture) by the tests that compare N ranks with it
VISION_10 = VISION + ["data.val_size=10", "data.test_size=10"]  # test_parity: SyncBatchNorm on and off
VISION_10_11 = VISION + ["data.val_size=10", "data.test_size=11"]  # test_fsdp, test_deepspeed: FSDP2, ZeRO-2


@pytest.mark.parametrize("n_eval", [pytest.param(10, marks=[FULL_MATRIX_ONLY]), 11])  # suite time: 10 opt-in
def test_three_processes_batchnorm_metrics_and_exact_eval_match_one(tmp_path, reference, n_eval):
    """3 ranks vs 1 on a BatchNorm CNN: SyncBatchNorm makes training equal, and every val/test sample
    counts exactly once although 10 or 11 samples do not split evenly over 3 ranks.

    Guards against Lightning's defaults: a padding DistributedSampler for val/test (10 samples on 3 ranks
    are evaluated as 12), and `self.log(sync_dist=True)` weighting uneven batches wrongly on gloo.
    """
    split = [f"data.val_size={n_eval}", f"data.test_size={n_eval}"]
    one = reference(VISION + split)
    three = train(tmp_path, "3", VISION + split + ["trainer=ddp", "trainer.devices=3"])
    within(max_param_diff(one["params"], three["params"]), 1e-5, "params")  # incl. BatchNorm running stats
    for tag in ["train/loss", "val/loss", "val/acc", "test/loss", "test/acc"]:
        assert_same_series(one, three, tag, 1e-5)
    # accuracy is a count over n_eval samples: a duplicated sample would show as a non-multiple of 1/n_eval
    acc = one["scalars"]["test/acc"][-1][1]
    assert abs(acc * n_eval - round(acc * n_eval)) < 1e-4


def test_without_syncbatchnorm_ranks_diverge_from_one_process(tmp_path, reference):
    """The switch works, and it matters: with plain BatchNorm, 3 ranks train differently from 1."""
    one = reference(VISION_10)
    off = train(tmp_path, "off", VISION_10 + ["trainer=ddp", "trainer.devices=3", "trainer.plugins.0.enabled=false"])
    assert max_param_diff(one["params"], off["params"]) > 1e-3
