"""nanoGPT's own train.py (github karpathy/nanoGPT), run as a way of bench.compare.throughput (`--nanogpt-repo DIR`).

bench/compare/nanogpt.py re-implements nanoGPT's model and loop for a CPU, where nanoGPT runs fp32 and uncompiled. On a GPU
the comparison to win is against nanoGPT itself: its train.py with its torch.compile, bf16 autocast, fused AdamW and
TF32, nothing re-typed. DIR is a checkout of karpathy/nanoGPT (model.py, train.py, configurator.py; the device
machine reaches no network, so it travels with the working tree: scripts/gpu_check.sh says how).

What this does for a run: writes the way's tokens as nanoGPT's `data/<name>/train.bin` and `val.bin` (uint16, as its
data/*/prepare.py do), in a work dir that also holds its configurator.py (train.py reads both relative to the
working directory), and runs `python DIR/train.py --key=value ...` there with the shape's sizes and the bench's
optimizer (lr, betas, weight decay, clip; no LR schedule, as the template's way runs), batch = the shape's batch,
`gradient_accumulation_steps=1` (one optimizer step per batch, as every other way), dropout 0, one evaluation of one
batch at iteration 0 and no checkpoint. nanoGPT prints each iteration's time ("iter N: loss L, time T ms, ...");
with `log_interval=1` (its default) it calls `loss.item()` every iteration, so a time covers that step's GPU work.

Two ways:
- `nanogpt_repo`: nanoGPT as it comes: no biases (`bias=False`, its default) and, for GPT-2's 50257-token
  vocabulary, its own rounding up to 50304 (no meta.pkl: "50257 rounded up for efficiency"); another vocabulary
  goes to meta.pkl as it is, as nanoGPT's own prepare.py for characters does.
- `nanogpt_repo_gpt2`: GPT-2's architecture, the template's model: biases in every Linear and LayerNorm and the
  exact vocabulary (meta.pkl).
Both compile with torch.compile on a GPU and not on a CPU (`--nanogpt-compile` decides otherwise), and use bf16
autocast when the bench's precision is bf16-mixed (on a CPU nanoGPT's autocast is a no-op: fp32 whatever is asked).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

GPT2_VOCAB = 50257
ITER = re.compile(r"^iter (\d+): loss (\S+), time ([\d.]+)ms")


def write_data(tokens, vocab_size: int, work: Path, as_it_comes: bool) -> None:
    """nanoGPT's data dir for the way: train.bin / val.bin (the same tokens: only train is timed) and meta.pkl."""
    data = work / "data" / "bench"
    data.mkdir(parents=True, exist_ok=True)
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.max() >= 2**16:
        raise ValueError(f"nanoGPT stores tokens as uint16; this vocabulary has ids up to {ids.max()}")
    for split in ("train", "val"):
        ids.astype(np.uint16).tofile(data / f"{split}.bin")
    meta = data / "meta.pkl"
    if as_it_comes and vocab_size == GPT2_VOCAB:
        meta.unlink(missing_ok=True)  # nanoGPT pads GPT-2's vocabulary to 50304 itself
    else:
        meta.write_bytes(pickle.dumps({"vocab_size": vocab_size}))


def command(repo: Path, shape: tuple, steps: int, optimizer: dict, device: str, precision: str, compile: bool,
            bias: bool, out_dir: Path) -> list[str]:  # fmt: skip
    """`python DIR/train.py --key=value ...`: nanoGPT's own configurator takes these."""
    layers, heads, width, ctx, batch = shape
    args = {
        "dataset": "bench",
        "out_dir": str(out_dir),
        "n_layer": layers,
        "n_head": heads,
        "n_embd": width,
        "block_size": ctx,
        "batch_size": batch,
        "gradient_accumulation_steps": 1,
        "dropout": 0.0,
        "bias": bias,
        "max_iters": steps - 1,  # its loop runs iterations 0..max_iters
        "eval_interval": 10**9,  # evaluates at iteration 0 only (eval_iters batches), saves nothing there
        "eval_iters": 1,
        "always_save_checkpoint": False,
        "log_interval": 1,
        "learning_rate": optimizer["lr"],
        "decay_lr": False,
        "weight_decay": optimizer["weight_decay"],
        "beta1": optimizer["betas"][0],
        "beta2": optimizer["betas"][1],
        "grad_clip": optimizer["clip"],
        "device": device,
        "dtype": "bfloat16" if precision == "bf16-mixed" else "float32",
        "compile": compile,
    }
    return [sys.executable, str(repo / "train.py"), *(f"--{k}={v}" for k, v in args.items())]


def iteration_times(stdout: str) -> list[float]:
    """Seconds of each iteration nanoGPT printed, in order (the first includes its iteration-0 evaluation)."""
    found = [(int(m[1]), float(m[3]) / 1e3) for m in map(ITER.match, stdout.splitlines()) if m]
    if not found or [i for i, _ in found] != list(range(len(found))):
        raise RuntimeError(f"nanoGPT's train.py printed no iteration times:\n{stdout[-2000:]}")
    return [t for _, t in found]


def run(repo: str, tokens, vocab_size: int, shape: tuple, steps: int, warmup: int, optimizer: dict, device: str,
        precision: str, compile: bool, as_it_comes: bool, work: str, out: str) -> None:  # fmt: skip
    """One run of nanoGPT's train.py; writes bench.compare.throughput's result JSON to `out`."""
    repo_dir, work_dir = Path(repo).resolve(), Path(work)
    if not (repo_dir / "train.py").is_file() or not (repo_dir / "configurator.py").is_file():
        raise SystemExit(f"--nanogpt-repo {repo}: not a checkout of karpathy/nanoGPT (no train.py/configurator.py)")
    work_dir.mkdir(parents=True, exist_ok=True)
    write_data(tokens, vocab_size, work_dir, as_it_comes)
    (work_dir / "configurator.py").write_text((repo_dir / "configurator.py").read_text())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}  # not its DDP mode
    cmd = command(repo_dir, shape, steps, optimizer, device, precision, compile, not as_it_comes, work_dir / "out")
    proc = subprocess.run(cmd, cwd=work_dir, env=env, capture_output=True, text=True)
    (work_dir / "stdout.txt").write_text(proc.stdout)  # what it printed: its vocabulary, its compile, its times
    if proc.returncode != 0:
        raise SystemExit(f"nanoGPT's train.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    times = iteration_times(proc.stdout)[warmup + 1 :]  # the same count as the other ways' step times
    layers, heads, width, ctx, batch = shape
    median = statistics.median(times)
    with open(out, "w") as f:
        json.dump(
            {
                "step_s": median,
                "tokens_per_s": batch * ctx / median,
                "steps_s": times,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,  # nanoGPT's
                "peak_gpu_mib": float("nan"),
            },
            f,
        )
