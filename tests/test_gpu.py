"""The GPU lane: what only a CUDA machine checks, `make test-gpu` on one H100/H200. Every test here is
marked `gpu` and skips without CUDA ("needs CUDA"), so the CPU suite collects them and says why. Each run of the lane
on a GPU is in docs/results/gpu_lane.jsonl; the tests that need 2 GPUs skip on one, saying so.

Tolerances on a GPU: fp32 matmuls do not use TF32 by default (torch.backends.cuda.matmul.allow_tf32 is False), but
cuBLAS picks kernels by shape and the backward of embeddings and of attention accumulates with atomics, so two
fp32 runs of the same model on one GPU differ in the last bits, and a few steps of AdamW (which divides by the
square root of its second moment) grow that to ~1e-6 relative; 1e-4 absolute on the parameters and losses of the
tests' tiny GPT-2 (values of order 1) leaves two orders of magnitude over that and still catches a wrong reduction
(which moves them by 1e-2 and more, as the CPU tests show).

GPU_LANE_ON_CPU=1 rehearses the lane on a CPU (`GPU_LANE_ON_CPU=1 make test-gpu`): the same tests with the CPU as
the device, so their own code (helpers, paths, what they read back) is known to run before device time is spent on
them; what needs CUDA itself (fp16's scaler, NCCL, DeepSpeed, the throughput peak, FlashAttention) skips there.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from conftest import shared

REHEARSAL = os.environ.get("GPU_LANE_ON_CPU") == "1" and not torch.cuda.is_available()  # the module docstring
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.cuda.is_available() and not REHEARSAL, reason="needs CUDA (the GPU lane: make test-gpu)"
    ),
]
CUDA_ITSELF = pytest.mark.skipif(REHEARSAL, reason="needs CUDA itself (GPU_LANE_ON_CPU=1 rehearses the rest)")

GPU = ["trainer.accelerator=cpu" if REHEARSAL else "trainer.accelerator=gpu", "trainer.devices=1"]
TOL = 1e-4  # the module docstring says why
THROUGHPUT = (
    "callbacks.throughput={_target_:src.callbacks.throughput.TokenThroughputMonitor,window_size:2}"  # QUIET's off
)


def gpt2_run(tmp_path, name: str, args: list[str]) -> dict:
    from test_parity import GPT2, train

    return train(tmp_path, name, GPT2 + args)


def losses(run: dict) -> list[float]:
    return [v for _, v in run["scalars"]["train/loss"]]


@pytest.mark.parametrize(
    "name,args",
    [
        ("bf16_mixed", ["trainer.precision=bf16-mixed"]),
        ("ddp_nccl", ["trainer=ddp", "trainer.precision=bf16-mixed"]),
        ("compile", ["model.compile=true", "trainer.precision=bf16-mixed"]),
        ("checkpointing", ["model.gradient_checkpointing=true", "trainer.precision=bf16-mixed"]),
        # the padded logits filled in place inside inductor's graph; its probe before step 1 checks them on the GPU
        ("pad_vocab", ["model.pad_vocab_multiple=64", "model.compile=true", "trainer.precision=bf16-mixed"]),
    ],
)
def test_a_recipe_trains_on_one_gpu(tmp_path, name, args):
    """train.py on one GPU: every logged loss finite and the last below the first (6 steps of the tiny GPT-2)."""
    run = gpt2_run(tmp_path, name, args + GPU)
    values = losses(run)
    assert len(values) == 6 and all(v == v and abs(v) < float("inf") for v in values) and values[-1] < values[0]


def test_keyed_dropout_on_a_gpu_is_the_same_with_accumulation_and_compiled(tmp_path):
    """Dropout 0.1 everywhere (src/core/dropout.py: masks hashed from seed, step, sample and module) on the GPU, fp32,
    as one compiled kernel a tensor (compile_dropout=auto on a GPU): 1 x 8 = 1 x 4 x accumulation 2 = the eager ops
    (compile_dropout=false) = the model compiled (inductor's kernels hash the same integers), every step."""
    base = ["model.dropout=0.1", "trainer.precision=32-true"] + GPU
    one = gpt2_run(tmp_path, "one", base)
    accumulated = gpt2_run(
        tmp_path, "acc", base + ["trainer.accumulate_grad_batches=2", "trainer.val_check_interval=12"]
    )
    eager_ops = gpt2_run(tmp_path, "eager_ops", base + ["compile_dropout=false"])
    compiled = gpt2_run(tmp_path, "compiled", base + ["model.compile=true"])
    for other in (accumulated, eager_ops, compiled):
        assert max(abs(a - b) for a, b in zip(losses(one), losses(other))) < TOL, (losses(one), losses(other))


def test_cuda_graphs_train_what_the_eager_model_trains(tmp_path):
    """model.compile_mode=reduce-overhead (the compiled model's kernels replayed as CUDA graphs, training and validation
    forwards) on the GPU, fp32: the logged losses and final parameters of the eager run within TOL (a graph that replays
    stale inputs or overwritten outputs moves them far more). On a CPU inductor skips the graphs: the rehearsal checks
    the compiled run alone."""
    from test_parity import max_param_diff

    base = ["trainer.precision=32-true"] + GPU
    eager = gpt2_run(tmp_path, "eager", base)
    graphs = gpt2_run(tmp_path, "graphs", base + ["model.compile=true", "model.compile_mode=reduce-overhead"])
    assert max(abs(a - b) for a, b in zip(losses(eager), losses(graphs))) <= TOL, (losses(eager), losses(graphs))
    assert max_param_diff(eager["params"], graphs["params"]) <= TOL


@CUDA_ITSELF
def test_compile_auto_compiles_a_long_training_run_on_this_gpu(tmp_path):
    """model.compile=auto (the default, src/lm/features/compiling.py) on a real GPU: the whole network for a training run of
    AUTO_MIN_STEPS steps, nothing for the lane's short runs (tests/test_compile.py decides each case on a CPU)."""
    from test_configs import compose_cfg

    from src.lm.features.compiling import AUTO_MIN_STEPS
    from src.run.checks import resolve_and_check_values

    for steps, want in ((AUTO_MIN_STEPS, True), (6, False)):
        cfg = compose_cfg([f"trainer.max_steps={steps}", *GPU], tmp=tmp_path)
        resolve_and_check_values(cfg)
        assert cfg.model.compile is want, (steps, cfg.model.compile)


@CUDA_ITSELF
def test_fp16_skips_an_overflow_step_and_logs_it(tmp_path):
    """trainer.precision=16-mixed (Lightning's GradScaler on CUDA): step 3's gradients overflow (one inf, the loss
    finite, tests/helpers/divergence.py). That update is skipped (the weights after step 3 are those before it),
    train/skipped_updates grows by one at step 3 and the run goes on: every loss finite, the last below the first."""
    import torch

    inf = ["+callbacks.inf._target_=tests.helpers.divergence.InfGradient", "+callbacks.inf.step=3"]
    run = gpt2_run(tmp_path, "fp16", ["trainer.precision=16-mixed", *inf] + GPU)
    values = losses(run)
    assert len(values) == 6 and all(abs(v) < float("inf") for v in values) and values[-1] < values[0]
    skipped = dict(run["scalars"]["train/skipped_updates"])
    assert skipped[2] - skipped.get(1, 0) == 1, skipped  # logged at step 2: the third step's
    scale = dict(run["scalars"]["train/loss_scale"])
    assert scale[2] == scale[1] / 2, scale
    (before,) = tmp_path.rglob("before_inf.pt")
    (after,) = tmp_path.rglob("after_inf.pt")
    a, b = (torch.load(p, map_location="cpu", weights_only=False)["state_dict"] for p in (before, after))
    assert all(torch.equal(a[k], b[k]) for k in a)


@CUDA_ITSELF
def test_the_throughput_callback_logs_mfu_on_this_gpu(tmp_path):
    """callbacks.throughput on the GPU, no peak_flops given: MFU is logged (an H200 by our dense table, an H100 by
    Lightning's), between 0 and 1."""
    run = gpt2_run(tmp_path, "mfu", [THROUGHPUT, "trainer.precision=bf16-mixed", *GPU])
    mfu = [v for _, v in run["scalars"]["train/device/mfu"]]
    assert mfu and all(0 < v < 1 for v in mfu), mfu


def test_fp32_on_a_gpu_trains_what_a_cpu_trains(tmp_path):
    """The same fp32 run on the GPU and on the CPU: the logged losses and final parameters within TOL."""
    from test_parity import max_param_diff

    gpu = gpt2_run(tmp_path, "gpu", GPU)
    cpu = gpt2_run(tmp_path, "cpu", ["trainer.accelerator=cpu", "trainer.devices=1"])
    assert max(abs(a - b) for a, b in zip(losses(gpu), losses(cpu))) <= TOL
    assert max_param_diff(gpu["params"], cpu["params"]) <= TOL


FSDP2_FILE = ["trainer=fsdp", "trainer.strategy.save_distributed_checkpoint=false"]  # one consolidated checkpoint
TWO_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < 2 and not REHEARSAL, reason="needs 2 CUDA GPUs (the 1-GPU cases run on one)"
)


@pytest.mark.parametrize(
    "name,args,devices",
    [
        ("fsdp2", FSDP2_FILE, 1),
        pytest.param("zero2", ["trainer=deepspeed", "trainer.strategy.stage=2"], 1, marks=CUDA_ITSELF),
        pytest.param("zero3", ["trainer=deepspeed", "trainer.strategy.stage=3"], 1, marks=CUDA_ITSELF),
        pytest.param("zero3_offload", ["trainer=deepspeed_stage_3_offload"], 1, marks=CUDA_ITSELF),
        pytest.param("ddp", ["trainer=ddp"], 2, marks=TWO_GPUS),
        pytest.param("fsdp2", FSDP2_FILE, 2, marks=TWO_GPUS),
        pytest.param("zero2", ["trainer=deepspeed", "trainer.strategy.stage=2"], 2, marks=[TWO_GPUS, CUDA_ITSELF]),
        pytest.param("zero3", ["trainer=deepspeed", "trainer.strategy.stage=3"], 2, marks=[TWO_GPUS, CUDA_ITSELF]),
    ],
)
def test_a_strategy_on_one_or_two_gpus_trains_the_plain_one_gpu_run(tmp_path, name, args, devices):
    """FSDP2 and real DeepSpeed (ZeRO-2, ZeRO-3, ZeRO-3 with CPU offload) on one GPU, and DDP, FSDP2, ZeRO-2 and
    ZeRO-3 on 2 GPUs (NCCL, the same global batch), fp32, against the plain one-GPU run: the logged losses and the
    consolidated final parameters within TOL. The CPU suite proves the same with gloo processes; 2 GPUs add NCCL's
    reductions and a device per rank."""
    if name.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs the deepspeed package")
    from test_fsdp import last_ckpt, train_sharded
    from test_parity import GPT2, max_param_diff

    from src.checkpoint.convert import load_checkpoint

    plain = gpt2_run(tmp_path, "plain", GPU)
    run = train_sharded(tmp_path, name, GPT2 + args + [GPU[0], f"trainer.devices={devices}"])
    params = load_checkpoint(last_ckpt(tmp_path, name))["state_dict"]
    assert max(abs(a - b) for a, b in zip(losses(plain), losses(run))) <= TOL
    assert max_param_diff(plain["params"], params) <= TOL


def test_lora_dpo_eval_and_export_on_a_gpu(tmp_path):
    """LoRA DPO from the tiny GPT-2 on the GPU, then eval.py and export-hf of its checkpoint."""
    from test_dpo import LORA, dpo_run_args
    from test_eval import evaluate
    from test_fsdp import last_ckpt
    from test_parity import train
    from transformers import AutoModelForCausalLM

    from src.checkpoint.convert import export_hf

    run = train(tmp_path, "dpo", dpo_run_args() + LORA + GPU + ["trainer.precision=bf16-mixed"])
    assert all(v == v for v in losses(run))
    metrics, _ = evaluate(tmp_path, last_ckpt(tmp_path, "dpo"), GPU)
    assert metrics["val/loss"] == metrics["val/loss"]
    AutoModelForCausalLM.from_pretrained(export_hf(last_ckpt(tmp_path, "dpo"), tmp_path / "hf"))


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (torch's SyncBatchNorm syncs nothing on 1)"
)
def test_torch_syncbatchnorm_on_two_gpus_trains_the_one_gpu_model(tmp_path):
    """The BatchNorm CNN under DDP on 2 GPUs (NCCL) with trainer.plugins' SyncBatchNorm, which there is torch's own
    nn.SyncBatchNorm (the CPU tests use the template's gloo one): the parameters, BatchNorm's running statistics
    included, and the logged losses of the 1-GPU run with the same global batch, within TOL. On one GPU a world of
    1 converts nothing and torch's SyncBatchNorm would sync nothing, so a single GPU cannot check it."""
    from test_parity import VISION_10, max_param_diff, train

    one = train(tmp_path, "one", VISION_10 + GPU)
    two = train(tmp_path, "two", VISION_10 + ["trainer=ddp", "trainer.accelerator=gpu", "trainer.devices=2"])
    assert max_param_diff(one["params"], two["params"]) <= TOL
    assert max(abs(a - b) for a, b in zip(losses(one), losses(two))) <= TOL


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_packed_rows_through_sdpa_on_the_gpu_give_the_padded_loss_and_gradients(model_type):
    """Packing without FlashAttention: packed rows (position ids, transformers' block mask) and the same conversations
    padded (attention mask) through SDPA's GPU kernels in fp32 (tests/test_chat.py's float64 check, on the device):
    the summed loss and every gradient within TOL, relative (records that saw each other move them by percents)."""
    from test_chat import packed_and_padded

    padded, packed = packed_and_padded(model_type, "cpu" if REHEARSAL else "cuda", torch.float32)
    assert abs(padded[0] - packed[0]) <= TOL * abs(padded[0])
    scale = max(g.abs().max().item() for g in padded[1])
    assert max((a - b).abs().max().item() for a, b in zip(padded[1], packed[1])) <= TOL * scale


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn")
def test_packing_through_flash_attention_varlen_is_the_masked_path(tmp_path):
    """data.packing=true with model.attn_implementation=flash_attention_2 (FlashAttention's variable-length path)
    against SDPA with the packed position ids, bf16: the logged losses within the bf16 tolerance of the CPU tests'
    packed-vs-padded check (3e-2 relative)."""
    from test_parity import train

    base = ["data=chat", f"model.pretrained={shared('tiny-gpt2')}", "data.packing=true", "data.seq_len=512",
            f"data.path={shared('chat', 'glaive_toolcall_en_demo.json')}", "trainer.max_steps=3",
            "trainer.val_check_interval=3", "test=false", "trainer.precision=bf16-mixed"] + GPU  # fmt: skip
    flash = train(tmp_path, "flash", base + ["model.attn_implementation=flash_attention_2"])
    sdpa = train(tmp_path, "sdpa", base + ["model.attn_implementation=sdpa"])
    for a, b in zip(losses(flash), losses(sdpa)):
        assert abs(a - b) <= 3e-2 * abs(b)
