"""What the benches share: the settings every way trains with, the shapes and the model they build, the clock and
the result file of a timed run, interleaved rounds and their paired ratios, the TRL side of the comparisons with TRL."""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import lightning as L

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT.parent / "shared" / "data" / "gpt2-tokenizer"  # GPT-2's: the benches against TRL train with it
LR, BETAS, WD, CLIP = 1e-3, (0.9, 0.95), 0.1, 1.0
# train.py with nothing but its training steps, as every bench's template way runs it (a bench adds its own timer)
TRAINING_ONLY = [
    "trainer.limit_val_batches=0",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_progress_bar=false",
    "test=false",
    "optimized_metric=null",
    "logger=none",
    "callbacks=none",
    "extras.print_config=false",
]


# The model every way trains, of one of these shapes
SHAPES = {  # name: (layers, heads, width, context, batch); the byte tokenizer (the default) keeps the LM head small
    "small": (4, 4, 128, 128, 16),
    "medium": (6, 6, 384, 256, 16),
    "ctx512": (6, 6, 384, 512, 8),  # longer contexts, same tokens per step: where SDPA starts to pay on a CPU
    "ctx1024": (6, 6, 384, 1024, 4),
    "overhead": (1, 1, 16, 16, 2),  # next to no compute: the step time is the loop's own cost per step
    "gpu": (12, 12, 768, 1024, 16),  # GPT-2 small's shape (124M with its vocabulary), for a GPU
    "llama3_1b": (16, 32, 2048, 2048, 8),  # --model llama: Llama-3.2-1B's (conf/model/size/llama3_1b.yaml), a GPU
}
# Fields a shape sets beyond arch_fields' rule (conf/model/size/llama3_1b.yaml's: 8 key/value heads, MLP 8192, tied;
# its rope_theta changes no FLOP and is left at the default)
EXACT = {"llama3_1b": {"num_key_value_heads": 8, "intermediate_size": 8192, "tie_word_embeddings": True}}


def arch_fields(model: str, shape: str) -> dict:
    """A SHAPES entry as the fields of `model`'s transformers config: for Llama-like models half as many key/value
    heads as query heads (GQA) and a SwiGLU MLP of 11/4 the width, as conf/model/llama.yaml's tiny preset."""
    layers, heads, width, ctx, batch = SHAPES[shape]
    if model == "gpt2":
        return {"n_layer": layers, "n_head": heads, "n_embd": width}
    return {
        "hidden_size": width,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2 if heads % 2 == 0 else heads,
        "intermediate_size": 11 * width // 4,
        "tie_word_embeddings": model == "qwen2",
        **EXACT.get(shape, {}),
    }


def device() -> str:
    """Where every way trains: BENCH_DEVICE (set from --device for the children)."""
    return os.environ.get("BENCH_DEVICE", "cpu")


def resolve_precision(precision: str) -> str:
    """auto: what train.py picks on this machine's CPU."""
    if precision != "auto":
        return precision
    from src.utils.machine import fastest_precision

    return fastest_precision("gpu" if device() == "cuda" else "cpu")


def data_and_model(
    shape: str,
    cache_dir: str,
    attn: str = "auto",
    precision: str = "32-true",
    activation: str = "gelu_pytorch_tanh",
    model_type: str = "gpt2",
    tokenizer: str = "bytes",
):
    """The token data and a freshly initialized model (GPT-2 unless `model_type`); attn "auto": the kernel
    train.py would pick; activation (GPT-2): the template's (conf/model/gpt2.yaml), or GPT2Config's own, gelu_new."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2LMHeadModel

    from src.lm.data.text import TextDataModule

    layers, heads, width, ctx, batch = SHAPES[shape]
    if attn == "auto":
        from src.utils.machine import fastest_attention

        attn = fastest_attention(device(), precision, ctx)
    dm = TextDataModule(seq_len=ctx, global_batch_size=batch, cache_dir=cache_dir, tokenizer=tokenizer)
    dm.setup()
    torch.manual_seed(0)
    if model_type != "gpt2":
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(
                model_type,
                vocab_size=dm.vocab_size,
                max_position_embeddings=ctx,
                attn_implementation=attn,
                **arch_fields(model_type, shape),
            )
        )
        model.loss_type = "ForCausalLM"
        return dm, model.to(device())
    model = GPT2LMHeadModel(gpt2_config(dm.vocab_size, ctx, (layers, heads, width), attn, activation))
    model.loss_type = "ForCausalLM"
    return dm, model.to(device())


def gpt2_config(vocab: int, positions: int, shape: tuple[int, int, int], attn: str, activation: str):
    """A GPT-2 config of `shape` (layers, heads, width) without dropout, as every bench's GPT-2 is."""
    from transformers import GPT2Config

    layers, heads, width = shape
    return GPT2Config(vocab_size=vocab, n_positions=positions, n_layer=layers, n_head=heads, n_embd=width,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn,
                      activation_function=activation)  # fmt: skip


def param_groups(model):
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


# Timing: each way writes its steps' times and peak memory to a JSON file
def clock() -> float:
    """Wall seconds; process CPU seconds under `--clock cpu` (BENCH_CLOCK=cpu in the children). On a GPU
    (BENCH_DEVICE=cuda) after the queued kernels have finished, so a step's time is its GPU work, not its launch."""
    if os.environ.get("BENCH_DEVICE") == "cuda":
        import torch

        torch.cuda.synchronize()
    return time.process_time() if os.environ.get("BENCH_CLOCK") == "cpu" else time.perf_counter()


class StepTimer(L.Callback):
    """Wall time at each optimizer step's end; writes the result when fit ends (used by the template run)."""

    def __init__(self, warmup: int, out: str) -> None:
        self.warmup, self.out, self.times = warmup, out, []
        self.start: Optional[float] = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = clock()

    def on_train_batch_end(self, trainer, *args) -> None:
        self.times.append(clock())

    def on_train_end(self, trainer, pl_module) -> None:
        data = trainer.datamodule
        items = data.batch_size * getattr(data, "seq_len", 1)  # tokens; samples for image data
        report(self.times, self.warmup, items, self.out, start=self.start)


def peak_gpu_mib() -> float:
    """The most GPU memory torch's allocator held (0 on a CPU run)."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if os.environ.get("BENCH_DEVICE") == "cuda" else 0.0


def report(times: list[float], warmup: int, tokens_per_step: int, out: str, start: Optional[float] = None) -> None:
    """The run's figures as JSON in `out`: the median step after `warmup` steps, and with `start` (the clock when
    training started) `warmup_extra_s`, what the warm-up steps took beyond as many median steps (compiling, autotuning,
    the allocator's first steps): what a compiled way must save back before it pays."""
    steps = [b - a for a, b in zip(times[warmup:], times[warmup + 1 :])]
    median = statistics.median(steps)
    extra = {} if start is None else {"warmup_extra_s": times[warmup] - start - (warmup + 1) * median}
    with open(out, "w") as f:
        json.dump(
            {
                "step_s": median,
                "tokens_per_s": tokens_per_step / median,
                "steps_s": steps,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "peak_gpu_mib": peak_gpu_mib(),
                **extra,
            },
            f,
        )


# Rounds: every way once a round, who goes first rotating; ratios of runs of one round
def interleaved(ways: list[str], rounds: int, run) -> dict[str, list[dict]]:
    """`run(way, round)` for every way in every round, who goes first rotating from round to round (a machine that
    slows during the bench slows every way alike); the results by way, in round order (for paired_ratio)."""
    results: dict[str, list[dict]] = {}
    for r in range(rounds):
        for way in ways[r % len(ways) :] + ways[: r % len(ways)]:
            results.setdefault(way, []).append(run(way, r))
    return results


def paired_ratio(numerator: list[dict], denominator: list[dict]) -> tuple[float, float, float]:
    """Lowest, median and highest of the per-round tokens/s ratios: runs of one round ran back to back.
    A round in which either run failed (None) is left out."""
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(numerator, denominator) if a and b]
    if not ratios:
        return (float("nan"),) * 3
    return min(ratios), statistics.median(ratios), max(ratios)


# TRL's side of the comparisons with TRL's trainers
def parse_trl_bench(ap, work: str, given: str):
    """The arguments of a bench that times TRL in a child run of itself (dpo, sft, grpo): `--work` (absolute once
    parsed) and what the child is handed, hidden from --help: `--child trl`, the data file `--<given>` and `--out`."""
    import argparse

    ap.add_argument("--work", default=work)
    ap.add_argument("--child", choices=["trl"], help=argparse.SUPPRESS)
    ap.add_argument(f"--{given}", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.work = os.path.abspath(args.work)
    return args


def run_way(cmd: list[str], way: str, out: str) -> dict:
    """Run one way's process `cmd` from the repository root: the JSON it wrote to `out`, or exit naming the way with
    the end of its output."""
    import subprocess

    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{way} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(Path(out).read_text())


def trl_child(module: str, args, keys: tuple[str, ...], **extra: str) -> list[str]:
    """The command that reruns bench `module` in a fresh process for its TRL way: `extra` and the named `args`."""
    named = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
    given = [f"--{k.replace('_', '-')}={v}" for k, v in extra.items()]
    return [sys.executable, "-m", module, "--child", "trl", *given, *named]


def trl_parts(args, n_positions: int) -> tuple:
    """What the benches' TRL runs share (dpo, sft, grpo): GPT-2's tokenizer with its EOS declared, a fresh GPT-2 of
    `args.shape` without dropout (seed 0, SDPA), a step timer and the times it records, and the trainer arguments
    both trainers take alike: fused AdamW, clipping 1.0, a constant LR, no weight decay, CPU, no saving."""
    import torch
    from transformers import AutoTokenizer, GPT2LMHeadModel, TrainerCallback

    layers, heads, width = map(int, args.shape.split(","))
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.eos_token = "<|endoftext|>"  # a bare tokenizer.json declares none (src/lm/data/tokenizers.py)
    torch.manual_seed(0)
    config = gpt2_config(len(tokenizer), n_positions, (layers, heads, width), "sdpa", "gelu")
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_end(self, *a, **k):
            times.append(clock())

    common = dict(
        output_dir=f"{args.work}/trl",
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=LR,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",
        lr_scheduler_type="constant",
        logging_steps=10_000,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        pad_token="<|endoftext|>",
        seed=0,
    )
    return tokenizer, GPT2LMHeadModel(config), times, Timer(), common
