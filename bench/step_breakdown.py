"""Where one training step's time goes, in a raw loop: data, forward, backward, clip + optimizer.

    python -m bench.step_breakdown [--shapes small,medium --precision auto --attn sdpa,eager]

Whatever a training loop adds or saves (the template's, transformers.Trainer's) can only come out of
the time outside forward and backward, which all three ways of bench.throughput spend in the same
Hugging Face GPT-2 modules. This bounds how far apart their tokens/s can be.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.throughput import BETAS, CLIP, LR, data_and_model, param_groups


def breakdown(shape: str, precision: str, steps: int, warmup: int, cache_dir: str, attn: str) -> dict[str, float]:
    dm, model = data_and_model(shape, cache_dir, attn, precision)
    opt = torch.optim.AdamW(param_groups(model), lr=LR, betas=BETAS, fused=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    parts: dict[str, list[float]] = {"data": [], "forward": [], "backward": [], "clip+optimizer": []}
    batches = iter(dm.train_dataloader())
    for step in range(steps):
        t0 = time.perf_counter()
        batch = next(batches)
        t1 = time.perf_counter()
        with autocast:
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        if step >= warmup:
            for part, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                parts[part].append(seconds)
    return {part: statistics.median(times) for part, times in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="small,medium")
    ap.add_argument("--precision", default="auto", choices=["auto", "32-true", "bf16-mixed"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--attn", default="auto", help="attention kernels to compare, e.g. sdpa,eager; auto: train.py's")
    ap.add_argument("--cache-dir", default=".cache/bench/tokens")
    args = ap.parse_args()
    if args.precision == "auto":
        from src.utils.resolvers import fastest_precision

        args.precision = fastest_precision("cpu")
    print(f"precision {args.precision}, median of {args.steps - args.warmup} steps, {torch.get_num_threads()} threads")
    for shape in args.shapes.split(","):
        for attn in args.attn.split(","):
            parts = breakdown(shape, args.precision, args.steps, args.warmup, args.cache_dir, attn)
            total = sum(parts.values())
            print(f"{shape:<8}{attn:<6}{total * 1e3:8.1f} ms/step  "
                  + "  ".join(f"{p} {s * 1e3:.1f} ms ({s / total:.1%})" for p, s in parts.items()))


if __name__ == "__main__":
    main()
