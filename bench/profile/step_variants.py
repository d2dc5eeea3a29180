"""One training step (forward, loss, backward, clip, AdamW) of GPT-2 variants and of bench/compare/nanogpt.py's GPT,
all in one process, interleaved in blocks, timed in thread CPU seconds on 1 thread: what each model-side
change is worth, measurable even on a busy shared machine (no process start-up, no loop of ours).

    python -m bench.profile.step_variants [--precision 32-true|bf16-mixed --rounds 5 --block 4 --shape small]
    python -m bench.profile.step_variants --wall   # all cores, wall clock: what a training run sees on a quiet machine
    python -m bench.profile.step_variants --gelu-kernels   # exact against tanh GELU alone, 1 and 2 threads

Variants: attention sdpa/eager x GELU gelu_new (GPT2Config's default: 8 ops) / gelu_pytorch_tanh (the same
tanh approximation in one kernel) / gelu (exact GELU, one kernel: the template's default and nanoGPT's) x
use_cache default/False (the template passes False on a CPU); and nanoGPT's model (always fp32, as on a CPU),
as it comes (bias=False) and with GPT-2's biases (bias=True); with `--nanogpt-dir`, also nanoGPT's own model.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch

from bench.common import BETAS, CLIP, LR, SHAPES, data_and_model, param_groups
from bench.compare import nanogpt


def hf_step(shape, cache_dir, precision, batch, attn, activation, use_cache=None, fused=True):
    _, model = data_and_model(shape, cache_dir, attn, precision, activation)
    opt = torch.optim.AdamW(param_groups(model), lr=LR, betas=BETAS, fused=fused)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    kwargs = {} if use_cache is None else {"use_cache": use_cache}

    def step():
        with autocast:
            logits = model(input_ids=batch["input_ids"], **kwargs).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def nanogpt_own_model(nanogpt_dir: Path, shape: str, vocab_size: int) -> torch.nn.Module:
    """nanoGPT's own model.py from a checkout (bias=False, its default), to check bench/compare/nanogpt.py's GPT against it."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", nanogpt_dir / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    layers, heads, width, ctx, _ = SHAPES[shape]
    return module.GPT(
        module.GPTConfig(
            block_size=ctx, vocab_size=vocab_size, n_layer=layers, n_head=heads, n_embd=width, dropout=0.0, bias=False
        )
    )


def nanogpt_step(shape, vocab_size, batch, bias=False, model=None):
    layers, heads, width, ctx, _ = SHAPES[shape]
    model = model or nanogpt.GPT(vocab_size, ctx, layers, heads, width, bias=bias)
    opt = torch.optim.AdamW(param_groups(model), lr=LR, betas=BETAS)  # torch's default on a CPU, as nanoGPT

    def step():
        _, loss = model(batch["input_ids"], batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def gelu_kernels(shape: str, rounds: int) -> None:
    """The MLP activation alone: forward + backward of exact and tanh-approximated GELU on one MLP activation
    (batch x ctx x 4 width), 1 and 2 threads, interleaved rounds of 10 calls; the median of the rounds."""
    layers, _, width, ctx, batch = SHAPES[shape]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        x = torch.randn(batch, ctx, 4 * width, requires_grad=True)
        grad = torch.randn_like(x)
        times = {"none": [], "tanh": []}
        for _ in range(rounds):
            for mode in times:
                start = time.perf_counter()
                for _ in range(10):
                    torch.nn.functional.gelu(x, approximate=mode).backward(grad)
                times[mode].append((time.perf_counter() - start) / 10)
        exact, tanh = statistics.median(times["none"]), statistics.median(times["tanh"])
        print(
            f"GELU fwd+bwd {tuple(x.shape)}, {threads} thread(s), wall: exact {exact * 1e3:.2f} ms, tanh "
            f"{tanh * 1e3:.2f} ms, tanh/exact {tanh / exact:.2f}; x {layers} layers: {layers * (tanh - exact) * 1e3:.1f} "
            "ms a step"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    ap.add_argument("--shape", default="small")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=4, help="steps per variant per round (the median is kept)")
    ap.add_argument("--cache-dir", default=".cache/bench/tokens")
    ap.add_argument("--gelu-kernels", action="store_true", help="only time the GELU kernels, exact against tanh")
    ap.add_argument(
        "--nanogpt-dir",
        type=Path,
        help="a checkout of github.com/karpathy/nanoGPT: also time its own model.py, against bench/compare/nanogpt.py's GPT",
    )
    ap.add_argument(
        "--wall",
        action="store_true",
        help="torch's default threads and the wall clock, not 1 thread's "
        "CPU time (some costs, e.g. copies, show only there)",
    )
    args = ap.parse_args()
    if args.gelu_kernels:
        return gelu_kernels(args.shape, rounds=15)
    clock = time.perf_counter if args.wall else time.thread_time
    if not args.wall:
        torch.set_num_threads(1)
    torch.manual_seed(0)
    dm, _ = data_and_model(args.shape, args.cache_dir, "sdpa", args.precision)
    batch = next(iter(dm.train_dataloader()))
    steps = {}
    for attn in ("sdpa", "eager"):
        steps[f"{attn} gelu_new"] = hf_step(args.shape, args.cache_dir, args.precision, batch, attn, "gelu_new")
        steps[f"{attn} gelu_new use_cache=False"] = hf_step(
            args.shape, args.cache_dir, args.precision, batch, attn, "gelu_new", use_cache=False
        )
        steps[f"{attn} gelu_pytorch_tanh"] = hf_step(
            args.shape, args.cache_dir, args.precision, batch, attn, "gelu_pytorch_tanh"
        )
        steps[f"{attn} gelu"] = hf_step(args.shape, args.cache_dir, args.precision, batch, attn, "gelu")
        steps[f"{attn} gelu use_cache=False"] = hf_step(
            args.shape, args.cache_dir, args.precision, batch, attn, "gelu", use_cache=False
        )
    steps["nanogpt (fp32)"] = nanogpt_step(args.shape, dm.vocab_size, batch)
    steps["nanogpt bias=True (fp32)"] = nanogpt_step(args.shape, dm.vocab_size, batch, bias=True)
    if args.nanogpt_dir:
        own = nanogpt_own_model(args.nanogpt_dir, args.shape, dm.vocab_size)
        steps["nanoGPT's own model.py (fp32)"] = nanogpt_step(args.shape, dm.vocab_size, batch, model=own)
    for step in steps.values():  # warm-up
        for _ in range(2):
            step()
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            block = []
            for _ in range(args.block):
                start = clock()
                step()
                block.append(clock() - start)
            times[name].append(statistics.median(block))
    base = statistics.median(times["nanogpt (fp32)"])
    how = f"{torch.get_num_threads()} threads, wall" if args.wall else "1 thread, thread CPU"
    print(
        f"{args.shape}, {args.precision}, {how} ms per step: median of {args.rounds} rounds "
        f"[lowest-highest]; speed vs nanoGPT"
    )
    for name, t in times.items():
        mid = statistics.median(t)
        print(f"{name:<32}{mid * 1e3:8.1f} [{min(t) * 1e3:.1f}-{max(t) * 1e3:.1f}]  {base / mid:.2f}x")


if __name__ == "__main__":
    main()
