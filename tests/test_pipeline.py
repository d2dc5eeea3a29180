"""trainer=pipeline (torch.distributed.pipelining on gloo) against one process, number for number:
losses at every step, validation, final parameters, resume, export; and the checks before anything runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import FULL_MATRIX_ONLY, once_per_session, path_overrides, read_events, run_script
from test_parity import GPT2, QUIET, assert_same_series, max_param_diff, train

from src.checkpoint.convert import build_module, export_hf, load_checkpoint
from tests.helpers.margins import close64, within

# Under pytest-xdist these tests run on one worker: they share module fixtures (runs) that it makes once.
pytestmark = pytest.mark.xdist_group("pipeline")

# 4 blocks: 2 stages of 2, or 4 stages of 1 for the interleaved schedule; a cosine schedule with warm-up,
# clipping by the whole model's norm at a value that does clip (the early gradient norms are above 0.5)
PIPE_GPT2 = GPT2 + ["model.n_layer=4", "trainer.gradient_clip_val=0.5"]
PIPELINE = [
    "trainer=pipeline",
    "trainer.devices=2",
    "trainer.gradient_clip_val=null",
    "trainer.strategy.gradient_clip_val=0.5",
]


def run_dir(tmp: Path, name: str) -> Path:
    (run,) = (tmp / name / "train" / "runs").iterdir()
    return run


def train_pipeline(tmp: Path, name: str, args: list[str], quiet: list[str] = QUIET) -> dict:
    """A pipeline run: its TensorBoard scalars (rank 0's file) and its DCP checkpoint's weights, all stages joined."""
    dirs = {"log_dir": tmp / name, "cache_dir": tmp / "cache"}
    run_script("train.py", quiet + path_overrides(dirs) + args)
    run = run_dir(tmp, name)
    ea = read_events(run / "tensorboard")
    scalars = {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}
    return {"scalars": scalars, "params": load_checkpoint(run / "checkpoints" / "last.ckpt")["state_dict"]}


# Validation at steps 3 and 6, every validation's checkpoint kept: the 1F1B run's step-3 checkpoint is where the
# resume test starts from, so no second straight pipeline run is needed.
EVERY_3 = ["trainer.val_check_interval=3", "callbacks.model_checkpoint.save_top_k=-1"]
SCHEDULES = {
    "GPipe": ["trainer.strategy.schedule=GPipe"],
    "1F1B": ["trainer.strategy.schedule=1F1B"],
    "Interleaved1F1B": ["trainer.strategy.schedule=Interleaved1F1B", "trainer.strategy.stages_per_rank=2"],
}
# the GPipe run also logs throughput (a window of 2 logging steps), to check the rates count each replica once
THROUGHPUT = ["callbacks.throughput.window_size=2"]


@pytest.fixture(scope="session")
def one(tmp_path_factory) -> dict:
    """The one-process run every 2-rank pipeline run is compared with (trained once per session, for all xdist
    workers)."""

    def make(tmp: Path) -> dict:
        return {**train(tmp, "one", PIPE_GPT2 + EVERY_3), "ckpt": run_dir(tmp, "one") / "checkpoints" / "last.ckpt"}

    return once_per_session(tmp_path_factory, "pipeline-one", make)


@pytest.fixture(scope="session")
def pipelines(tmp_path_factory):
    """Each schedule's 2-rank run, trained on first use (once per session) and shared by the tests (the tmp dir
    comes along)."""
    runs: dict[str, tuple[Path, dict]] = {}

    def make(schedule: str, tmp: Path) -> tuple[Path, dict]:
        quiet = [a for a in QUIET if a != "callbacks.throughput=null"] if schedule == "GPipe" else QUIET
        extra = THROUGHPUT if schedule == "GPipe" else []
        return tmp, train_pipeline(tmp, "pipe", PIPE_GPT2 + EVERY_3 + PIPELINE + SCHEDULES[schedule] + extra, quiet)

    def get(schedule: str) -> tuple[Path, dict]:
        if schedule not in runs:
            runs[schedule] = once_per_session(tmp_path_factory, f"pipeline-{schedule}", lambda tmp: make(schedule, tmp))
        return runs[schedule]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(  # suite time: GPipe and 1F1B in the full matrix (interleaved 1F1B stays)
    "schedule", [pytest.param(s, marks=[FULL_MATRIX_ONLY] if s in ("GPipe", "1F1B") else []) for s in SCHEDULES]
)
def test_pipeline_schedules_match_one_process(tmp_path, one, pipelines, schedule):
    """2 ranks, 4 micro-batches: train loss at every step, val loss (52 samples in batches of 8: a short last batch) and
    final parameters equal one process's, with the tied wte/lm_head, clipping and an LR schedule."""
    tmp, pipe = pipelines(schedule)
    assert_same_series(one, pipe, "train/loss", 1e-5)
    assert_same_series(one, pipe, "val/loss", 1e-5)
    assert len(pipe["scalars"]["train/loss"]) == 6 and len(pipe["scalars"]["val/loss"]) == 2
    within(max_param_diff(one["params"], pipe["params"]), 1e-5, "params")
    # the Hugging Face export of the stages' checkpoint gives the template's logits on its weights (which are the
    # one process's, above): two computations of one function, in float64
    from transformers import AutoModelForCausalLM

    last = run_dir(tmp, "pipe") / "checkpoints" / "last.ckpt"
    hf = AutoModelForCausalLM.from_pretrained(export_hf(last, tmp_path / "hf")).eval()
    module, _ = build_module(load_checkpoint(last))
    ids = torch.randint(0, 257, (2, 32))
    with torch.no_grad():
        close64(hf.double()(ids).logits, module.double()(ids).logits, "export-hf logits")
    if schedule == "GPipe":
        # both ranks of the one pipeline read the same 8 samples a step: over all ranks, samples/s is 8 x batches/s
        # (batches/s counts the replica's batches once, as samples/s counts its samples once)
        scalars = pipe["scalars"]
        assert scalars["train/batches_per_sec"] and scalars["validate/batches_per_sec"]
        for stage in ("train", "validate"):
            for (_, samples), (_, batches) in zip(
                scalars[f"{stage}/samples_per_sec"], scalars[f"{stage}/batches_per_sec"]
            ):
                assert samples / batches == pytest.approx(8 if stage == "train" else 52 / 7), stage


@pytest.mark.slow
def test_pipeline_resumes_exactly_and_evaluates(tmp_path, pipelines):
    """Resumed mid-epoch from its step-3 checkpoint (DCP shards of both stages, with the optimizer and LR
    schedule), a 1F1B run ends where the straight 6-step run ends; eval.py reads the checkpoint."""
    tmp, straight = pipelines("1F1B")
    ckpts = run_dir(tmp, "pipe") / "checkpoints"
    args = PIPE_GPT2 + EVERY_3 + PIPELINE + SCHEDULES["1F1B"]
    resumed = train_pipeline(tmp_path, "resumed", args + [f"ckpt_path={ckpts / 'step_000003.ckpt'}"])
    within(max_param_diff(straight["params"], resumed["params"]), 1e-6, "params")
    assert load_checkpoint(run_dir(tmp_path, "resumed") / "checkpoints" / "last.ckpt")["global_step"] == 6
    steps = dict(straight["scalars"]["train/loss"])
    after = resumed["scalars"]["train/loss"]
    assert [s for s, _ in after] == list(range(3, 6))  # only the steps after the checkpoint ran
    assert max(abs(v - steps[s]) for s, v in after) <= 1e-6
    # eval.py on one process (it consolidates the shards) gives the run's last validation loss
    proc = run_script(
        "eval.py",
        [
            f"ckpt_path={ckpts / 'last.ckpt'}",
            *QUIET[:3],
            f"paths.log_dir={tmp_path / 'eval'}",
            f"paths.cache_dir={tmp_path / 'cache'}",
            "trainer.precision=32-true",
        ],
    )
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("EVAL "))
    metrics = {k: float(v) for k, v in (kv.split("=") for kv in line[5:].split())}
    within(abs(metrics["val/loss"] - straight["scalars"]["val/loss"][-1][1]), 5e-5, "eval.py val/loss")  # 5 decimals


@pytest.mark.slow
def test_data_x_pipeline_on_four_ranks_with_instruction_data(tmp_path):
    """2 data-parallel replicas x 2 stages on padded Alpaca records (prompt labels -100, one padded length
    per batch): the global batch is split over the replicas only, and losses and parameters equal one process.

    Plain SGD without clipping: an update proportional to the gradient, so a data-parallel gradient of the
    wrong scale (e.g. averaged over the replicas instead of summed) shows in the parameters (Adam and
    clipping would hide a uniform scale; both are covered on 2 ranks above)."""
    from conftest import shared

    args = [
        "data=instruct",
        f"data.path={shared('alpaca', 'alpaca_en_demo.json')}",
        "data.seq_len=256",
        "data.global_batch_size=8",
        "seed=7",
        "model.n_layer=2",
        "model.n_embd=32",
        "model.n_head=2",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=2",
        "test=false",
        "model.scheduler.num_warmup_steps=1",
        "model.optimizer._target_=torch.optim.SGD",
        "model.optimizer.lr=1.0",
        "~model.optimizer.betas",
        "~model.optimizer.eps",
        "model.optimizer.fused=false",
        "trainer.gradient_clip_val=null",
    ]
    one = train(tmp_path, "one", args)
    pipe = train_pipeline(
        tmp_path,
        "pipe",
        args
        + PIPELINE
        + ["trainer.devices=4", "trainer.strategy.n_microbatches=2", "trainer.strategy.gradient_clip_val=null"],
    )
    assert_same_series(one, pipe, "train/loss", 1e-5)
    assert_same_series(one, pipe, "val/loss", 1e-5)
    within(max_param_diff(one["params"], pipe["params"]), 1e-5, "params")


@pytest.mark.slow
@FULL_MATRIX_ONLY  # suite time: test_architectures_parity's llama-pipeline_tp runs pipeline x tensor on 4 ranks
def test_pipeline_x_tensor_on_four_ranks_matches_one_process(tmp_path, one):
    """2 stages x 2 tensor-parallel ranks per stage (each stage's blocks split as trainer=tp splits them, 1 head per
    rank, and checkpointed: src/parallel/parallelize.py's steps 1 and 2): every step's train loss, the val losses, the final weights (the DCP shards of all 4 ranks joined and turned
    back into GPT-2's layout) and the HF export's logits equal one process's, with the tied wte/lm_head, clipping by
    the whole model's norm (over stages and tensor-parallel shards) and the LR schedule; resumed from its step-3
    checkpoint, it ends where it ended."""
    args = (
        PIPE_GPT2
        + EVERY_3
        + PIPELINE
        + SCHEDULES["1F1B"]
        + ["trainer.devices=4", "trainer.strategy.tensor_parallel_size=2"]
        + ["model.gradient_checkpointing=true"]  # each stage's blocks recomputed in backward: the same numbers
    )
    pipe = train_pipeline(tmp_path, "pipe", args)
    assert_same_series(one, pipe, "train/loss", 1e-5)
    assert_same_series(one, pipe, "val/loss", 1e-5)
    assert len(pipe["scalars"]["train/loss"]) == 6 and len(pipe["scalars"]["val/loss"]) == 2
    within(max_param_diff(one["params"], pipe["params"]), 1e-5, "params")
    last = run_dir(tmp_path, "pipe") / "checkpoints" / "last.ckpt"
    assert torch.load(last / "meta.pt", weights_only=False)["tensor_parallel"] == {
        "model_type": "gpt2",
        "size": 2,
        "n_head": 2,
    }
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(export_hf(last, tmp_path / "hf")).eval()
    module, _ = build_module(load_checkpoint(last))  # its weights are the one process's (above)
    ids = torch.randint(0, 257, (2, 32))
    with torch.no_grad():
        close64(hf.double()(ids).logits, module.double()(ids).logits, "export-hf logits")
    resumed = train_pipeline(tmp_path, "resumed", args + [f"ckpt_path={last.parent / 'step_000003.ckpt'}"])
    assert [s for s, _ in resumed["scalars"]["train/loss"]] == [3, 4, 5]
    within(max_param_diff(pipe["params"], resumed["params"]), 1e-6, "params")


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("TEST_8_RANKS") != "1",
    reason="8 gloo processes, more than the suite's 2-4 on a 2-core machine: TEST_8_RANKS=1 runs it",
)
def test_data_x_pipeline_x_tensor_on_eight_ranks_matches_one_process(tmp_path, one):
    """The 2 x 2 x 2 mesh: 2 replicas of 2 stages of 2 tensor-parallel ranks == 1 process (loss, val loss, weights)."""
    pipe = train_pipeline(
        tmp_path,
        "pipe",
        PIPE_GPT2
        + EVERY_3
        + PIPELINE
        + SCHEDULES["1F1B"]
        + ["trainer.devices=8", "trainer.strategy.tensor_parallel_size=2"],
    )
    assert_same_series(one, pipe, "train/loss", 1e-5)
    assert_same_series(one, pipe, "val/loss", 1e-5)
    within(max_param_diff(one["params"], pipe["params"]), 1e-5, "params")


# ---- checked before any process starts: one sentence naming the key and the fix (no processes, fast) ----


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.n_layer=3"], r"model.n_layer=3 does not divide into pipeline_parallel_size=2 x stages_per_rank=1"),
        (
            ["trainer.strategy.schedule=Interleaved1F1B", "trainer.strategy.stages_per_rank=2", "model.n_layer=2"],
            r"model.n_layer=2 does not divide into .* = 4 stages",
        ),
        (
            ["trainer.strategy.schedule=1F1B", "trainer.strategy.n_microbatches=1"],
            r"n_microbatches=1 is fewer than the 2",
        ),
        (["trainer.strategy.n_microbatches=3"], r"global_batch_size=8 does not divide into 1 data-parallel .* = 3"),
        (["trainer.devices=3"], r"3 process\(es\) do not divide into pipeline_parallel_size=2"),
        (["trainer.strategy.schedule=gpipe"], r"schedule='gpipe' is not known"),
        (["trainer.strategy.stages_per_rank=2"], r"stages_per_rank=2 does not fit schedule=GPipe"),
        (["model.compile=true"], r"model.compile=true is not supported with trainer=pipeline"),
        (["model.lora.enabled=true"], r"model.lora.enabled=true is not supported with trainer=pipeline"),
        (["trainer.gradient_clip_val=0.5"], r"set trainer.strategy.gradient_clip_val instead"),
        (["trainer.accumulate_grad_batches=2"], r"raise trainer.strategy.n_microbatches instead"),
        (["model=convnet", "data=digits"], r"splits transformers decoder LMs only"),
        (
            ["model=causal_lm", "model.model_type=opt", "+model.config.num_hidden_layers=2"],
            r"trainer=pipeline needs a pipeline plan and opt.s config has none",
        ),
        (
            ["model=llama", "model.config.num_hidden_layers=3"],
            r"model.config.num_hidden_layers=3 does not divide into pipeline_parallel_size=2",
        ),
        (
            ["trainer.devices=4", "trainer.strategy.tensor_parallel_size=2", "model.n_head=3", "model.n_embd=48"],
            r"model.n_head=3 and model.n_embd=48 must both divide by trainer.strategy.tensor_parallel_size=2",
        ),
        (["trainer.strategy.tensor_parallel_size=0"], r"tensor_parallel_size=0 is not valid"),
        (
            ["trainer.devices=6", "trainer.strategy.tensor_parallel_size=2"],
            r"6 process\(es\) do not divide into pipeline_parallel_size=2 x tensor_parallel_size=2 = 4",
        ),
        (
            ["trainer.devices=8", "trainer.strategy.tensor_parallel_size=2", "trainer.strategy.n_microbatches=8"],
            r"global_batch_size=8 does not divide into 2 data-parallel replica\(s\) x trainer.strategy.n_microbatches=8 = 16",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_pipeline_config_is_checked_before_anything_runs(tmp_path, overrides, message):
    from test_configs import compose_cfg

    from src.run.checks import resolve_and_check_values
    from src.utils.config import ConfigError

    cfg = compose_cfg(["trainer=pipeline", "trainer.devices=2", "data.global_batch_size=8", *overrides], tmp=tmp_path)
    with pytest.raises(ConfigError, match=message) as error:
        resolve_and_check_values(cfg)
    assert "\n" not in str(error.value)


def test_mesh_sizes_must_multiply_to_the_world_size():
    from src.parallel.mesh import mesh_sizes
    from src.utils.config import ConfigError

    assert mesh_sizes(8, pipeline_parallel=2, tensor_parallel=2) == {
        "data_parallel": 2,
        "pipeline_parallel": 2,
        "tensor_parallel": 2,
    }
    with pytest.raises(ConfigError, match=r"world size 8 is not data_parallel_size=3 x .* = 6"):
        mesh_sizes(8, data_parallel=3, pipeline_parallel=2)
